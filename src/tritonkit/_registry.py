"""Where each op lives: the one list that the package's public names (``tritonkit.softmax``), the op
registry (``tritonkit.ops.get_op``, ``get_workload``) and so the benchmarks, tests and CLI read.
Plain data, so that reading it imports nothing.

A family's op module -> the public functions it defines, the ops in its ``OPS`` (each a contract the
tests check) and the workloads in its ``WORKLOADS`` (what the benchmarks run of those ops:
``attention`` and ``attention_causal`` are the one op flash_attention's, full and causal).
"""

FAMILIES = {
    "tritonkit.ops.bias_gelu": {
        "public": ("bias_gelu",),
        "ops": ("bias_gelu",),
        "workloads": ("bias_gelu",),
    },
    "tritonkit.ops.softmax.softmax": {
        "public": ("softmax", "log_softmax"),
        "ops": ("softmax", "log_softmax"),
        "workloads": ("softmax", "log_softmax"),
    },
    "tritonkit.ops.norm": {
        "public": ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"),
        "ops": ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"),
        "workloads": ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"),
    },
    "tritonkit.ops.attention.attention": {
        "public": ("flash_attention", "scaled_dot_product_attention"),
        "ops": ("flash_attention",),
        "workloads": ("attention", "attention_causal"),
    },
    "tritonkit.ops.attention.decode": {  # no gradient, its own cases: tests/test_attention_decode.py
        "public": ("flash_attention_with_kvcache",),
        "ops": (),
        "workloads": (),
    },
    "tritonkit.ops.cross_entropy": {
        "public": ("cross_entropy",),
        "ops": ("cross_entropy",),
        "workloads": ("cross_entropy",),
    },
    "tritonkit.ops.linear_cross_entropy": {
        "public": ("linear_cross_entropy",),
        "ops": ("linear_cross_entropy",),
        "workloads": ("linear_cross_entropy",),
    },
    "tritonkit.ops.rotary": {
        "public": ("apply_rotary_pos_emb", "apply_rotary_emb"),
        "ops": ("rotary_pos_emb",),
        "workloads": ("rotary_pos_emb",),
    },
    "tritonkit.ops.quantize": {  # its op contract (a gradient-free op with fp8 outputs) is its tests'
        "public": ("quantize_fp8",),
        "ops": (),
        "workloads": (),
    },
    "tritonkit.ops.scaled_mm": {  # likewise (fp8 inputs, no gradient): tests/test_scaled_mm.py
        "public": ("scaled_mm",),
        "ops": (),
        "workloads": (),
    },
    "tritonkit.ops.float8_linear": {  # its recipes' tests: tests/test_float8_linear.py
        "public": ("float8_linear",),
        "ops": (),
        "workloads": (),
    },
    "tritonkit.ops.linear": {
        "public": ("linear", "gated_linear"),
        "ops": ("linear", "linear_bare", "gated_linear"),
        "workloads": ("linear", "linear_bare", "gated_linear"),
    },
}
# public names that are modules: tritonkit.nn, tritonkit.distributed, tritonkit.tuning
SUBPACKAGES = ("nn", "distributed", "tuning")

PUBLIC = {name: module for module, family in FAMILIES.items() for name in family["public"]} | {
    name: f"tritonkit.{name}" for name in SUBPACKAGES
}
OP_MODULES = {op: module for module, family in FAMILIES.items() for op in family["ops"]}
WORKLOAD_MODULES = {name: module for module, family in FAMILIES.items() for name in family["workloads"]}
