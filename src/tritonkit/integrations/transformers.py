"""tritonkit inside a Hugging Face transformers model, one model instance at a time.

``apply(model)`` patches one model in place and returns it; ``unapply(model)`` restores it. Nothing
global changes: each patched module gets a ``forward`` of its own (an instance attribute, so that an
unpatched model of the same class in the same process runs as before), and the attention goes
through transformers' attention-function registry under the name ``"tritonkit"``, set on this
model's config only, with the mask function registered beside it (so a causal model stays causal).
Parameters, state_dict keys and ``save_pretrained`` are untouched.

What is patched (each can be turned off):
- ``rms_norm``: every RMSNorm module (``weight * x / rms(x)``, x normalized in fp32; Gemma's
  ``(1 + weight)`` form) runs ``tritonkit.rms_norm``; Qwen3's and Gemma 3's per-head q/k norms
  included.
- ``attention``: ``flash_attention``, causal as the module says, the sliding window and soft cap
  transformers passes, padded batches through the packed (varlen) path. Generation with
  transformers' KV cache takes the decode kernel (``flash_attention_with_kvcache``) for its steps
  where nothing is padded, the packed path where something is. A static cache's buffers are longer
  than the tokens so far: the packed path reads them up to the padding mask's length (transformers
  passes a mask whenever one is given to generate); without a mask the decode kernel reads each
  sequence's keys up to its queries' last position (``position_ids``), its prefill included where
  the ``rope`` patch tells it the cache is static (``register()`` alone cannot: pass a mask).
- ``mlp``: the gated MLP (``down(act(gate(x)) * up(x))``) computes ``act(gate(x)) * up(x)`` in one
  ``gated_linear`` kernel.
- ``cross_entropy``: a causal LM's training forward (labels given, grad enabled, training mode)
  takes its loss by ``linear_cross_entropy`` from the last hidden states, so the (tokens, vocab)
  logits are never held; the loss is fp32 as transformers' is, and the output's ``logits`` None.
  Without labels, in eval mode or under no_grad the logits are computed as before.
- ``rope``: transformers applies the rotation through a module-level function inside each
  attention's forward, which cannot be replaced for one model alone, so the attention modules get
  a forward of their own (``_attention_module_forward``): transformers' steps (projections, Qwen3's
  per-head norms, the cache's update, the configured attention function, the output projection)
  with q and k rotated by ``tritonkit.apply_rotary_pos_emb`` in one launch. Of the patches it is
  the one that follows transformers' code most closely; written against 5.17's and 5.24's.

Mixed precision: fp32 parameters under ``torch.autocast`` (fp16 or bf16) work as transformers'
modules do there: the gated MLP's and the LM head's weights are cast to autocast's dtype for their
products (as autocast casts a Linear's), the RMSNorms run in fp32, and gradients reach the fp32
parameters. Without autocast an fp32 model's attention raises (the kernels take 16-bit q, k, v).

A module replaced after ``apply`` (a PEFT/LoRA wrapper around a projection), or one whose weights
or inputs are in a dtype its kernel does not take (fp32 for the gated MLP and the loss outside
autocast), is run as transformers wrote it: each patched forward checks its preconditions at every
call and falls back to the module's own forward when one fails.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import torch

import tritonkit

NAME = "tritonkit"  # the attention implementation's name in transformers' registries
# config.model_type: the Llama family, whose attention, gated MLP and RMSNorm (weight * normalized
# x) are the same modules under other names, and Gemma 2 and 3 (text), whose RMSNorm is
# (1 + weight) * x in fp32, whose attention soft-caps its scores (Gemma 2) and whose LM head caps
# its logits (Gemma 2)
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
TESTED_VERSIONS = "5.17, 5.24 and 5.25 (the CPU suite; the GPU machines have 5.17)"
HALVES = (torch.float16, torch.bfloat16)  # what the attention, gated MLP and loss kernels take
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
# new query tokens a call may have for the decode kernel (generation without padding, no gradient);
# more take the prefill kernel
DECODE_QUERIES = 16
# the keyword by which the attention modules' forward tells attention_forward that the cache is a
# static one (transformers' is_compileable): its buffers hold slots not yet written
STATIC_CACHE = "_tritonkit_static_cache"
_PATCHES = "_tritonkit_patches"  # the model's record of what apply() changed, for unapply()


# ---------------------------------------------------------------- registration


def register() -> None:
    """Register ``"tritonkit"`` as an attention implementation (and its mask function) in
    transformers' registries, so that ``from_pretrained(..., attn_implementation="tritonkit")`` and
    ``model.set_attn_implementation("tritonkit")`` take it. Idempotent; ``apply`` calls it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, attention_forward)
    # the kernels take a causal mask (and windows) as flags and padding as packed sequences:
    # the 2D padding mask, or None where nothing is padded, as flash-attn's integration gets it
    AttentionMaskInterface.register(NAME, flash_attention_mask)


# ---------------------------------------------------------------- attention


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: query (B, Hq, Sq, D), key and value (B, Hkv,
    Sk, D), the attention mask from the registered mask function (None, or (B, Sk) with 1 for a
    token and 0 for padding); returns the output as (B, Sq, Hq, D) and no attention weights."""
    if dropout:
        raise NotImplementedError(
            f"tritonkit attention has no dropout (got {dropout}); set the config's attention_dropout to 0"
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"tritonkit attention takes a (batch, keys) padding mask, got shape "
            f"{tuple(attention_mask.shape)}: register() its mask function, or set the implementation "
            f"with model.set_attn_implementation"
        )
    if query.dtype not in HALVES:
        raise TypeError(
            f"tritonkit attention takes float16 or bfloat16 q, k and v, got {query.dtype}: cast the "
            f"model (model.to(torch.bfloat16)), run it under torch.autocast(dtype=torch.bfloat16), or "
            f"apply with attention=False"
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    window = (sliding_window - 1, 0 if causal else sliding_window - 1) if sliding_window else (-1, -1)
    options = {"causal": causal, "scale": scaling, "window": window, "softcap": float(softcap or 0.0)}
    static = kwargs.pop(STATIC_CACHE, False)
    if attention_mask is None:  # the mask function gives one only where something is padded
        seq_q, seq_k = query.shape[2], key.shape[2]
        # a few new tokens over the cache, or a static cache's prefill (its buffers hold slots not
        # yet written): the decode kernel, which reads each sequence's keys up to its queries' last
        # position only, laid out as it takes them
        if not torch.is_grad_enabled() and (seq_q <= DECODE_QUERIES or (static and seq_k > seq_q)):
            q, k, v = (t.transpose(1, 2) for t in (query, key, value))
            lengths = (
                _key_lengths(kwargs.get("position_ids"), query.shape[0], seq_k) if seq_k > seq_q else None
            )
            return tritonkit.flash_attention_with_kvcache(q, k, v, cache_seqlens=lengths, **options), None
        return tritonkit.flash_attention(query, key, value, **options).transpose(1, 2), None
    return _padded_attention(query, key, value, attention_mask.bool(), options), None


def _key_lengths(position_ids, batch: int, seq_k: int) -> torch.Tensor | None:
    """Each sequence's keys in the cache, (B,) int32, from its queries' last position (no host sync):
    at most the keys given (a sliding window's cache holds fewer than the positions); None (every
    key) where transformers passed no positions. Every layer of a step gets the same position_ids
    tensor: the lengths are made once a step (four small launches a layer fewer) and reused while
    the call is that tensor, unchanged (its version), with the last call's sizes."""
    global _last_lengths
    if not isinstance(position_ids, torch.Tensor):
        return None
    reusable = _reusable(position_ids)
    made_for = (position_ids._version, batch, seq_k)
    (positions, last_for), lengths = _last_lengths
    if reusable and positions is position_ids and last_for == made_for:
        return lengths
    last = position_ids.reshape(-1, position_ids.shape[-1])[:, -1]
    lengths = (last + 1).clamp(max=seq_k).to(torch.int32).expand(batch).contiguous()
    if reusable:
        _last_lengths = ((position_ids, made_for), lengths)
    return lengths


# the last step's key lengths: ((position_ids, (their version, batch, keys)), lengths); holding the
# positions keeps their id from passing to another tensor
_last_lengths: tuple = ((None, None), None)


def _reusable(t: torch.Tensor) -> bool:
    """Whether a tensor made from ``t`` by an earlier call may stand for this call's: not while
    torch.compile traces, nor while a CUDA graph captures (the graph must make its own, which its
    replays remake from the positions it reads then)."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _padded_attention(query, key, value, keep: torch.Tensor, options: dict) -> torch.Tensor:
    """Attention over the tokens ``keep`` marks (B, Sk), each sequence packed apart (its queries are
    its last Sq positions); padded query rows come out zero."""
    batch, heads_q, seq_q, head_dim = query.shape
    if key.shape[2] > keep.shape[1]:  # a static cache's buffers: the slots past the mask hold nothing yet
        key, value = key[:, :, : keep.shape[1]], value[:, :, : keep.shape[1]]
    keep_q = keep[:, -seq_q:]
    rows_k, rows_q = keep.flatten().nonzero().squeeze(1), keep_q.flatten().nonzero().squeeze(1)
    k = key.transpose(1, 2).flatten(0, 1).index_select(0, rows_k)
    v = value.transpose(1, 2).flatten(0, 1).index_select(0, rows_k)
    q = query.transpose(1, 2).flatten(0, 1).index_select(0, rows_q)
    zero = torch.zeros(1, dtype=torch.int32, device=query.device)
    cu_k = torch.cat([zero, keep.sum(1).cumsum(0).to(torch.int32)])
    cu_q = torch.cat([zero, keep_q.sum(1).cumsum(0).to(torch.int32)])
    packed = tritonkit.flash_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **options)
    out = packed.new_zeros(batch * seq_q, heads_q, head_dim)
    return out.index_copy(0, rows_q, packed).view(batch, seq_q, heads_q, head_dim)


# ---------------------------------------------------------------- the modules' forwards


def _gemma_rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm: x normalized and scaled by (1 + weight) in fp32, rounded once."""
    if not _is_tensor(self.weight):
        return type(self).forward(self, x)
    return tritonkit.rms_norm(x, self.weight.shape, 1.0 + self.weight.float(), self.eps)


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if hidden_states.dtype != weight.dtype or not _is_tensor(weight):
        return type(self).forward(self, hidden_states)
    return tritonkit.rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj, self.up_proj
    plain = all(_plain_linear(m) and m.bias is None for m in (gate, up))
    dtype = _compute_dtype(x)
    if (
        not plain
        or dtype not in HALVES
        or not all(m.weight.dtype in (dtype, torch.float32) for m in (gate, up))
    ):
        return type(self).forward(self, x)
    weights = (gate.weight.to(dtype), up.weight.to(dtype))  # autocast's casts of fp32 weights
    return self.down_proj(tritonkit.gated_linear(x.to(dtype), *weights, self._tritonkit_activation))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of x (an activation or a weight) runs in: autocast's where it is on (fp32
    weights, bf16 products), else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _causal_lm_forward(self, input_ids=None, *args, labels=None, logits_to_keep=0, **kwargs):
    """The loss from the last hidden states by ``linear_cross_entropy``, as transformers'
    ForCausalLMLoss defines it (labels shifted left, -100 ignored, a mean over the kept tokens, or a
    sum over ``num_items_in_batch``), where it pays and applies; else the model's own forward. It
    is installed showing the class forward's signature (_with_signature_of), which generate reads:
    ``logits_to_keep`` there makes a prefill compute the LM head at the last position only."""
    own = type(self).forward
    fused = (
        labels is not None
        and not args
        and self.training
        and torch.is_grad_enabled()
        and _plain_linear(self.lm_head)
        and self.lm_head.bias is None
        and _compute_dtype(self.lm_head.weight) in HALVES
        and isinstance(logits_to_keep, int)
        and logits_to_keep == 0
        and kwargs.get("return_dict", True) is not False
        and kwargs.get("shift_labels") is None
    )
    if not fused:
        return own(self, input_ids, *args, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    num_items = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    outputs = self.model(input_ids=input_ids, **kwargs)
    hidden = outputs.last_hidden_state
    dtype = _compute_dtype(self.lm_head.weight)  # under autocast the head's product runs in its dtype
    hidden, head = hidden.to(dtype), self.lm_head.weight.to(dtype)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].to(hidden.device)
    reduction = "mean" if num_items is None else "sum"
    loss = tritonkit.linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        head,
        shifted.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
        softcap=getattr(self.config, "final_logit_softcapping", None),  # Gemma 2's tanh cap
        loss_dtype=torch.float32,  # transformers' loss upcasts the logits: an fp32 loss
    )
    if num_items is not None:
        loss = loss / num_items
    rest = {name: value for name, value in outputs.items() if name != "last_hidden_state"}
    return CausalLMOutputWithPast(loss=loss, logits=None, **rest)


def _attention_module_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """The Llama family's attention with the rotation by ``tritonkit.apply_rotary_pos_emb``: q, k and
    v projected as transformers does (Qwen3's per-head norms first), q and k rotated in one launch
    from the projections' (B, S, H, D) views, the cache updated, then the configured attention
    function (tritonkit's where ``attention=True``) and the output projection. The cache comes as
    ``cache`` (transformers 5.24) or ``past_key_values`` (5.17); its update takes the call's keywords
    as 5.24 passes them (5.17's ignores them)."""
    cos_sin_fit = position_embeddings is not None and position_embeddings[0].dtype == hidden_states.dtype
    if not cos_sin_fit or hidden_states.dtype not in HALVES + (torch.float32,):
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)
    cache = kwargs.pop("cache", None) if "cache" in kwargs else kwargs.pop("past_key_values", None)
    input_shape = hidden_states.shape[:-1]
    heads = (*input_shape, -1, self.head_dim)
    q, k = self.q_proj(hidden_states).view(heads), self.k_proj(hidden_states).view(heads)
    if hasattr(self, "q_norm"):  # Qwen3: RMSNorm of each head before the rotation
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = position_embeddings
    q, k = (t.transpose(1, 2) for t in tritonkit.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2))
    v = self.v_proj(hidden_states).view(heads).transpose(1, 2)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        if self.config._attn_implementation == NAME and getattr(cache, "is_compileable", False):
            kwargs[STATIC_CACHE] = True  # buffers longer than the tokens so far (attention_forward)
    model_module = sys.modules[type(self).__module__]
    interface = model_module.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, model_module.eager_attention_forward
    )
    # Mistral's window is its config's; Qwen2's, Qwen3's and Gemma's the layer's (None on full
    # layers); Gemma 2 soft-caps its scores
    window = (
        self.sliding_window
        if hasattr(self, "sliding_window")
        else getattr(self.config, "sliding_window", None)
    )
    if getattr(self, "attn_logit_softcapping", None) is not None:
        kwargs["softcap"] = self.attn_logit_softcapping
    out, weights = interface(
        self,
        q,
        k,
        v,
        attention_mask,
        dropout=self.attention_dropout if self.training else 0.0,
        scaling=self.scaling,
        sliding_window=window,
        **kwargs,
    )
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _plain_linear(module) -> bool:
    """A torch.nn.Linear itself (not a subclass: a PEFT/LoRA layer adds to its output)."""
    return type(module) is torch.nn.Linear


def _is_tensor(weight) -> bool:
    return type(weight) in (torch.Tensor, torch.nn.Parameter)


# ---------------------------------------------------------------- apply, unapply


def _rms_norm_kind(module: torch.nn.Module) -> Callable | None:
    """The forward for transformers' RMSNorm modules: the Llama family's (weight * (x normalized in
    fp32, cast back); ``variance_epsilon``), Gemma's ((1 + weight) * x normalized, in fp32; ``eps``);
    None for any other module."""
    name = type(module).__name__
    if not (name.endswith("RMSNorm") and hasattr(module, "weight")):
        return None
    if hasattr(module, "variance_epsilon"):
        return _rms_norm_forward
    return _gemma_rms_norm_forward if name.startswith("Gemma") and hasattr(module, "eps") else None


def _is_attention(module: torch.nn.Module) -> bool:
    """The Llama family's attention module: q/k/v/o projections, a head dim, a layer index."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "layer_idx", "scaling")
    return type(module).__name__.endswith("Attention") and all(hasattr(module, n) for n in names)


def _is_gated_mlp(module: torch.nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def _activation(model) -> str:
    name = getattr(model.config, "hidden_activation", None) or model.config.hidden_act  # Gemma's first
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"tritonkit's gated MLP takes the activations {sorted(_ACTIVATIONS)}, not {name!r}: "
            f"pass mlp=False"
        )
    return _ACTIVATIONS[name]


def _with_signature_of(own: Callable, forward: Callable) -> Callable:
    """``forward`` presenting ``own``'s signature (``inspect.signature`` follows ``__wrapped__``):
    transformers' generate reads the model's forward signature to decide what to pass it (without
    ``attention_mask`` there it builds no padding mask, and a prompt holding the pad token attends
    to it) and which logits to ask for (``logits_to_keep``). A copy of ``forward``, not a wrapper
    around it: no extra call on every module's forward (a decode step makes hundreds)."""
    patched = types.FunctionType(
        forward.__code__, forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__
    )
    patched.__kwdefaults__ = forward.__kwdefaults__
    patched.__wrapped__ = own
    return patched


def _patch(record: list, module: torch.nn.Module, forward: Callable, **attributes) -> None:
    if "forward" in vars(module):
        hooked = hasattr(module, "_hf_hook") * " (an accelerate hook: a model dispatched across devices)"
        raise ValueError(
            f"{type(module).__name__} already has a forward of its own{hooked}; tritonkit patches "
            f"only modules that run their class's forward, and left the model as it was"
        )
    module.forward = types.MethodType(_with_signature_of(type(module).forward, forward), module)
    for name, value in attributes.items():
        setattr(module, name, value)
    record.append((module, ("forward", *attributes)))


def _undo(record: list) -> None:
    """Remove what ``_patch`` set on each module of ``record``."""
    for module, names in record:
        for name in names:
            delattr(module, name)


def apply(
    model: torch.nn.Module,
    *,
    rms_norm: bool = True,
    rope: bool = True,
    attention: bool = True,
    mlp: bool = True,
    cross_entropy: bool = True,
) -> torch.nn.Module:
    """Patch one transformers model in place (see the module's docstring) and return it.

    Models: Llama, Mistral, Qwen2, Qwen3, Gemma 2 and Gemma 3's text model (``SUPPORTED``;
    transformers ``TESTED_VERSIONS``); any other raises ValueError naming its model_type. A model
    patched already raises (``unapply`` it first)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise ValueError(
            f"tritonkit.integrations.transformers supports the model types {SUPPORTED}, not "
            f"{model_type!r} ({type(model).__name__})"
        )
    if hasattr(model, _PATCHES):
        raise ValueError(f"{type(model).__name__} is patched already: unapply(model) first")
    record: list = []
    activation = _activation(model) if mlp else None
    try:
        for module in model.modules():
            if rms_norm and (norm_forward := _rms_norm_kind(module)) is not None:
                _patch(record, module, norm_forward)
            elif mlp and _is_gated_mlp(module):
                _patch(record, module, _mlp_forward, _tritonkit_activation=activation)
            elif rope and _is_attention(module):
                _patch(record, module, _attention_module_forward)
        if cross_entropy and hasattr(model, "lm_head") and hasattr(model, "model"):
            _patch(record, model, _causal_lm_forward)
        previous = config._attn_implementation
        if attention:
            register()
            model.set_attn_implementation(NAME)
    except Exception:  # all or nothing: the modules patched before the one that failed run as before
        _undo(record)
        raise
    setattr(model, _PATCHES, (record, previous))
    return model


def unapply(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``apply``: every patched module runs its class's forward again, and the attention
    implementation is the one the model had. Returns the model."""
    if not hasattr(model, _PATCHES):
        raise ValueError(f"{type(model).__name__} is not patched by tritonkit")
    record, previous = getattr(model, _PATCHES)
    delattr(model, _PATCHES)
    _undo(record)
    if model.config._attn_implementation != previous:
        model.set_attn_implementation(previous)
    return model


def is_applied(model: torch.nn.Module) -> bool:
    return hasattr(model, _PATCHES)
