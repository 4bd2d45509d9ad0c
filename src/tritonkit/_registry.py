"""Where each op lives: the one list that the package's public names (``tritonkit.softmax``), the op
registry (``tritonkit.ops.get_op``) and so the benchmarks, tests and CLI read. Plain data, so that
reading it imports nothing.

A family's op module -> the public functions it defines and the specs in its ``SPECS`` (an op's
benchmark workloads: ``attention`` and ``attention_causal`` are flash_attention's, full and causal).
"""

FAMILIES = {
    "tritonkit.ops.bias_gelu": {"public": ("bias_gelu",), "specs": ("bias_gelu",)},
    "tritonkit.ops.softmax.softmax": {
        "public": ("softmax", "log_softmax"),
        "specs": ("softmax", "log_softmax"),
    },
    "tritonkit.ops.norm": {
        "public": ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"),
        "specs": ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"),
    },
    "tritonkit.ops.attention.attention": {
        "public": ("flash_attention", "scaled_dot_product_attention"),
        "specs": ("attention", "attention_causal"),
    },
    "tritonkit.ops.linear": {
        "public": ("linear", "gated_linear"),
        "specs": ("linear", "linear_bare", "gated_linear"),
    },
}
SUBPACKAGES = ("nn", "distributed")  # public names that are modules: tritonkit.nn, tritonkit.distributed

PUBLIC = {name: module for module, family in FAMILIES.items() for name in family["public"]} | {
    name: f"tritonkit.{name}" for name in SUBPACKAGES
}
SPEC_MODULES = {spec: module for module, family in FAMILIES.items() for spec in family["specs"]}
