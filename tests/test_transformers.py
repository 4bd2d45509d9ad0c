"""tritonkit.integrations.transformers on tiny random models (no downloads): a patched model against
the same model unpatched, with the oracle's rule (the unpatched model in float64 the reference, in
bf16 torch's error); generation, padding, per-instance patching, unapply and the errors."""

from __future__ import annotations

import copy
import functools
import inspect
import os
import types

import pytest
import torch

import gloo
import tritonkit
from tritonkit.oracle import compare

transformers = pytest.importorskip("transformers")
from tritonkit.integrations import transformers as tk_hf  # noqa: E402

pytestmark = pytest.mark.integration

VOCAB, HIDDEN, HEADS, KV_HEADS, SEQ = 96, 64, 4, 2, 12
# the MLP's width: not the hidden size (its projections stay non-square) and, at 48, two of the
# interpreter's 32-wide tiles (the second ragged) and three 16-deep steps, where twice the hidden
# size took four and eight and most of the models' kernel time
INTERMEDIATE = 48
SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": 1,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "max_position_embeddings": 64,
}
GEMMA = {
    "num_hidden_layers": 2,
    "head_dim": HIDDEN // HEADS,
    "query_pre_attn_scalar": 16,
    "sliding_window": 5,
}
CONFIGS = {  # Gemma 2: a sliding layer then a full one, its scores and logits soft-capped
    "llama": lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=False),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=5),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=HIDDEN // HEADS, tie_word_embeddings=False),
    "gemma2": lambda: transformers.Gemma2Config(**SMALL | GEMMA),
    "gemma3": lambda: transformers.Gemma3TextConfig(**SMALL | GEMMA | {"num_hidden_layers": 1}),
}


def _model(kind: str, dtype=torch.bfloat16, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](), attn_implementation="eager")
    if not kind.startswith("gemma"):  # the peers' attention: sdpa, but eager for Gemma, whose
        model.set_attn_implementation("sdpa")  # scores' soft cap sdpa drops (5.17 runs Gemma 2 so)
    for parameter in model.parameters():  # O(1) weights: the default init's 0.02 leaves logits ~0
        parameter.data.normal_(0, 0.3 if parameter.dim() > 1 else 1.0)
    return model.to(dtype)


def _batch(seed: int = 1, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt's tokens carry no loss
    return ids, labels


def _run(model, ids, labels, mask=None):
    """(logits in eval mode, loss and every parameter's gradient in train mode)."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return logits, *_train(model, ids, labels, mask)


def _train(model, ids, labels, mask=None):
    """(loss, every parameter's gradient) in train mode."""
    model.train()
    model.zero_grad()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return loss, grads


def _check(kind: str, mask=None, dtype=torch.float16, device="cpu", autocast=None, **patches):
    """The oracle's rule on logits, loss and every gradient. fp16 by default on the CPU: in bf16 a
    whole model's sums carry one gradient past the rule (gemma2's gate_proj weight at 2.5x torch's
    bf16 error, with the interpreter's casts rounding as the GPU's); the GPU test runs bf16."""
    ids, labels = (t.to(device) for t in _batch())
    if mask is not None:
        mask = mask.to(device)
        labels = labels.masked_fill(mask == 0, -100)
    reference = _model(kind, dtype).to(device)
    exact = _run(copy.deepcopy(reference).double(), ids, labels, mask)
    with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        in_dtype = _run(copy.deepcopy(reference), ids, labels, mask)
        ours = _run(tk_hf.apply(copy.deepcopy(reference), **patches), ids, labels, mask)
    dtype = autocast or dtype
    if mask is not None:  # a padded position's logits are nobody's: compare the tokens'
        exact, in_dtype, ours = ((r[0][mask.bool()], *r[1:]) for r in (exact, in_dtype, ours))
    comparisons = [
        compare("logits", ours[0], in_dtype[0], exact[0], dtype),
        compare("loss", ours[1], in_dtype[1], exact[1], dtype),
    ]
    comparisons += [
        compare(f"grad {name}", ours[2][name], in_dtype[2][name], exact[2][name], dtype) for name in exact[2]
    ]
    failed = [c for c in comparisons if not c.passed]
    assert not failed, failed


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_patched_model_matches_the_unpatched_one(kind):
    _check(kind)


def test_mixed_precision_fp32_weights_under_autocast():
    """fp32 parameters, fp16 autocast (AMP training): the matmuls' weights cast as autocast casts
    them, the fused loss kept (no logits), fp32 gradients, within the oracle against float64."""
    _check("llama", dtype=torch.float32, autocast=torch.float16)
    model = tk_hf.apply(_model("llama", torch.float32)).train()
    ids, labels = _batch()
    with torch.autocast("cpu", dtype=torch.float16):
        assert model(input_ids=ids, labels=labels).logits is None


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_gpu_bf16_models_match_the_unpatched_ones(kind):
    _check(kind, dtype=torch.bfloat16, device="cuda")


def test_padded_batches_take_the_packed_path():
    """Right-padded rows (training batches): each sequence attends its own tokens only."""
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, -4:] = 0
    _check("llama", mask)


@pytest.mark.parametrize(
    "cache, padded",
    [("dynamic", True), ("dynamic", False), ("static", True), ("static", False)],
)
def test_greedy_generation_gives_the_same_tokens_up_to_a_tie(padded, cache, monkeypatch):
    """transformers' KV cache, dynamic or static (buffers of the longest length, slots past the
    tokens so far unwritten, which the attention once read), prompts left-padded (the packed path)
    or not (a static cache's steps take the packed path too, the mask being shorter than its
    buffers): the patched model picks the unpatched model's tokens, except where two candidates'
    float64 logits are closer than bf16's own error (where unpatched bf16 could pick either); the
    sequences are compared up to the first such step."""
    model = _model("qwen2").eval()
    exact = copy.deepcopy(model).double()
    ids, _ = _batch(seed=2)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0 if padded else 1
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "cache_implementation": cache}
    expected = model.generate(input_ids=ids, attention_mask=copy.copy(mask), **settings)
    decode_calls = []
    decode = tritonkit.flash_attention_with_kvcache
    monkeypatch.setattr(
        tritonkit, "flash_attention_with_kvcache", lambda *a, **k: decode_calls.append(1) or decode(*a, **k)
    )
    got = tk_hf.apply(copy.deepcopy(model)).generate(input_ids=ids, attention_mask=mask, **settings)
    assert bool(decode_calls) != padded  # the decode kernel where unpadded, never where padded
    assert got.shape == expected.shape
    full_mask = torch.cat([mask, torch.ones_like(got[:, ids.shape[1] :])], dim=1)
    for row in range(got.shape[0]):
        differ = (got[row] != expected[row]).nonzero()
        if not len(differ):
            continue
        step = differ[0].item()
        prefix = {"input_ids": got[row : row + 1, :step], "attention_mask": full_mask[row : row + 1, :step]}
        with torch.no_grad():
            reference = exact(**prefix).logits[0, -1]
            bf16 = model(**prefix).logits[0, -1].double()
        tie = 2 * (bf16 - reference).abs().max() + 2**-7
        gap = (reference[expected[row, step]] - reference[got[row, step]]).abs()
        assert gap <= tie, (row, step, float(gap), float(tie))


def test_a_static_cache_without_a_mask_reads_only_written_slots():
    """No mask and no pad token (the attention gets None) over a static cache, whose buffers hold
    unwritten slots past the prompt: every step's logits as near the float64 model's as unpatched
    bf16's are (the prefill once attended to the empty slots: 0.3 off, relatively, at step 0)."""
    model = _model("qwen2").eval()
    exact = copy.deepcopy(model).double()
    ids, _ = _batch(seed=2)
    settings = {"max_new_tokens": 4, "do_sample": False, "cache_implementation": "static"}
    settings |= {"output_scores": True, "return_dict_in_generate": True}
    got = tk_hf.apply(copy.deepcopy(model)).generate(input_ids=ids, **settings)
    with torch.no_grad():  # step 0, the prefill's last logits, against the same prompt's in float64
        reference = exact(input_ids=ids).logits[:, -1]
        bf16 = model(input_ids=ids).logits[:, -1].double()
    bound = 4 * ((bf16 - reference).norm() / reference.norm()) + 0.01
    assert (got.scores[0].double() - reference).norm() / reference.norm() <= bound


def test_a_steps_key_lengths_are_made_once_for_its_layers(monkeypatch):
    """Every layer of a decode step gets the same position_ids: the lengths tensor made for the
    first is the one the others get, and anything that changes them makes it anew: the positions
    written in place, another batch or cache length, other positions, or a trace."""
    positions = torch.tensor([[5], [9]])
    first = tk_hf._key_lengths(positions, 2, 8)
    assert first.tolist() == [6, 8]  # (the second clamped to the cache's 8 keys)
    assert tk_hf._key_lengths(positions, 2, 8) is first
    positions[1, 0] = 2  # written in place: its version moves
    again = tk_hf._key_lengths(positions, 2, 8)
    assert again is not first and again.tolist() == [6, 3]
    assert tk_hf._key_lengths(positions, 2, 16).tolist() == [6, 3]
    assert tk_hf._key_lengths(positions[:1], 4, 16).tolist() == [6] * 4
    assert tk_hf._key_lengths(torch.tensor([[1], [2]]), 2, 16).tolist() == [2, 3]
    settled = tk_hf._key_lengths(positions, 2, 8)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert tk_hf._key_lengths(positions, 2, 8) is not settled


def test_patched_forwards_keep_their_class_signature_and_generate_masks_the_pad_token():
    """generate reads the model's forward signature: without ``attention_mask`` there it built no
    padding mask, so a prompt holding the pad token (Gemma 2's is 0) attended to it in the patched
    model alone (first-step scores 3.2 off, other tokens). Every patched forward shows its class's."""
    model = _model("gemma2", dtype=torch.float16).eval()
    patched = tk_hf.apply(copy.deepcopy(model))
    modules = [m for m in patched.modules() if "forward" in vars(m)]
    assert modules
    for module in modules:
        assert inspect.signature(module.forward) == inspect.signature(type(module).forward.__get__(module))
    ids = torch.tensor([[10, 56, 25, 3, 88, 72], [0, 53, 61, 19, 10, 75]])
    assert model.config.pad_token_id == 0
    settings = {
        "max_new_tokens": 2,
        "do_sample": False,
        "output_scores": True,
        "return_dict_in_generate": True,
    }
    expected, got = model.generate(ids, **settings), patched.generate(ids, **settings)
    assert (got.scores[0] - expected.scores[0]).abs().max().item() < 0.1


def test_generation_asks_the_patched_model_for_the_last_logits_only():
    """generate passes logits_to_keep=1 only to a forward whose signature names it: else a prefill
    computes the LM head over every prompt token."""
    model = tk_hf.apply(_model("llama")).eval()
    assert model._supports_logits_to_keep()
    ids, _ = _batch()
    with torch.no_grad():
        last = model(input_ids=ids, logits_to_keep=1).logits
        every = model(input_ids=ids).logits
    assert last.shape[1] == 1 and torch.equal(last[:, 0], every[:, -1])


def test_the_patch_is_per_instance_and_unapply_restores_the_bits():
    ids, labels = _batch()
    patched, sibling = _model("llama"), _model("llama")
    before = sibling(input_ids=ids).logits
    tk_hf.apply(patched)
    assert tk_hf.is_applied(patched) and not tk_hf.is_applied(sibling)
    layer = patched.model.layers[0]
    for module in (layer.self_attn, layer.mlp, layer.input_layernorm, patched.model.norm, patched):
        assert "forward" in vars(module), type(module).__name__
    assert sibling.config._attn_implementation == "sdpa"
    assert not any("forward" in vars(m) for m in sibling.modules())
    assert torch.equal(sibling(input_ids=ids).logits, before)
    state = {name: t.clone() for name, t in patched.state_dict().items()}
    unpatched = patched(input_ids=ids).logits
    tk_hf.unapply(patched)
    assert patched.config._attn_implementation == "sdpa"
    assert not any("forward" in vars(m) for m in patched.modules())
    assert torch.equal(patched(input_ids=ids).logits, before)  # same weights, same seed as sibling
    assert not torch.equal(unpatched, before)  # the patched model ran other kernels
    assert state.keys() == patched.state_dict().keys()


def test_the_patched_modules_compile_without_a_graph_break():
    """torch.compile(fullgraph=True) of the patched gated MLP and attention (RoPE, the registry's
    lookup, tritonkit's attention): the same bits as eager."""
    model = tk_hf.apply(_model("llama", torch.float16)).train()
    layer = model.model.layers[0]
    x = torch.randn(2, SEQ, HIDDEN, dtype=torch.float16, requires_grad=True)
    cos_sin = model.model.rotary_emb(x, torch.arange(SEQ)[None].expand(2, -1))
    for module in (layer.mlp, lambda h: layer.self_attn(h, cos_sin, None)[0]):
        torch._dynamo.reset()
        assert torch.equal(torch.compile(module, fullgraph=True)(x), module(x))


def test_a_static_caches_decode_step_compiles_without_a_graph_break(monkeypatch):
    """generate's compiled decoding (a static cache: transformers compiles the forward for it):
    the patched model's step on one new token a sequence under torch.compile(fullgraph=True), the
    decode kernel and the key lengths traced, gives eager's bits and writes the same cache."""
    model = tk_hf.apply(_model("llama")).eval()
    ids, _ = _batch(seed=3)
    caches = [transformers.StaticCache(config=model.config, max_cache_len=2 * SEQ) for _ in range(2)]
    token, position = ids[:, -1:], torch.tensor([SEQ])

    def step(cache):
        positions = position[None].expand(ids.shape[0], -1)
        kept = {"cache_position": position, "position_ids": positions}
        return model(token, cache=cache, use_cache=True, **kept).logits

    with torch.no_grad():
        for cache in caches:
            model(ids, cache=cache, use_cache=True, cache_position=torch.arange(SEQ))
        decode, calls = tritonkit.flash_attention_with_kvcache, []
        with monkeypatch.context() as patch:  # (eager: the step takes the decode kernel)
            patch.setattr(
                tritonkit, "flash_attention_with_kvcache", lambda *a, **k: calls.append(1) or decode(*a, **k)
            )
            expected = step(caches[0])
        assert len(calls) == len(model.model.layers)
        torch._dynamo.reset()
        got = torch.compile(step, fullgraph=True)(caches[1])
    assert torch.equal(got, expected)
    for eager_layer, compiled_layer in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(eager_layer.keys, compiled_layer.keys)


def test_each_patch_can_be_left_out():
    model = tk_hf.apply(_model("llama"), rope=False, mlp=False, cross_entropy=False)
    layer = model.model.layers[0]
    assert "forward" in vars(layer.input_layernorm) and model.config._attn_implementation == "tritonkit"
    assert not any("forward" in vars(m) for m in (layer.self_attn, layer.mlp, model))
    model = tk_hf.apply(_model("llama"), rms_norm=False, attention=False)
    assert model.config._attn_implementation == "sdpa" and "forward" not in vars(model.model.norm)


def test_the_loss_without_logits_and_gradient_accumulations_sum():
    """Training: no logits held, and ``num_items_in_batch`` (HF Trainer's gradient accumulation)
    divides a sum, as transformers' loss does."""
    model = tk_hf.apply(_model("llama")).train()
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None and out.loss.dtype == torch.float32  # transformers' loss is fp32
    summed = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(7)).loss
    kept = int((labels[:, 1:] != -100).sum())
    torch.testing.assert_close(summed.float(), out.loss.float() * kept / 7, rtol=1e-2, atol=0)


def test_the_attention_alone_by_its_registered_name():
    """``register()`` then ``attn_implementation="tritonkit"``: transformers' own modules around
    tritonkit's attention, the logits within the oracle of the sdpa model's."""
    tk_hf.register()
    ids, _ = _batch()
    model = _model("llama").eval()
    exact = copy.deepcopy(model).double()
    model.set_attn_implementation("tritonkit")
    assert model.config._attn_implementation == "tritonkit"
    with torch.no_grad():
        ours, reference = model(input_ids=ids).logits, exact(input_ids=ids).logits
        model.set_attn_implementation("sdpa")
        torch_bf16 = model(input_ids=ids).logits
    assert compare("logits", ours, torch_bf16, reference, torch.bfloat16).passed


def test_a_module_replaced_after_apply_runs_its_own_forward():
    """A LoRA-style wrapper around the gate projection (a Linear subclass adding to its output): the
    patched MLP sees it is no plain Linear and runs transformers' forward, so the adapter counts."""

    class Adapter(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1.0

    model = tk_hf.apply(_model("llama"))
    mlp = model.model.layers[0].mlp
    adapter = Adapter(HIDDEN, INTERMEDIATE, bias=False, dtype=torch.bfloat16)
    adapter.weight.data.copy_(mlp.gate_proj.weight)
    mlp.gate_proj = adapter
    x = torch.randn(3, HIDDEN, dtype=torch.bfloat16)
    expected = mlp.down_proj(mlp.act_fn(adapter(x)) * mlp.up_proj(x))
    assert torch.equal(mlp(x), expected)


def test_bad_configurations_fail_clearly():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))
    with pytest.raises(ValueError, match="'gpt2'"):
        tk_hf.apply(gpt2)
    model = _model("llama")
    fp32 = tk_hf.apply(_model("llama", dtype=torch.float32)).eval()  # fine under autocast, not without
    with pytest.raises(TypeError, match="float16 or bfloat16 q, k and v.*autocast"):
        fp32(input_ids=_batch()[0])
    tk_hf.apply(model)
    with pytest.raises(ValueError, match="patched already"):
        tk_hf.apply(model)
    with pytest.raises(ValueError, match="not patched"):
        tk_hf.unapply(_model("llama"))
    hooked = _model("llama")  # a module with a forward of its own (a hook's) late in the model: refused,
    hooked.model.norm.forward = types.MethodType(type(hooked.model.norm).forward, hooked.model.norm)
    with pytest.raises(ValueError, match="RMSNorm already has a forward of its own.*left the model as it"):
        tk_hf.apply(hooked)
    patched = [m for m in hooked.modules() if "forward" in vars(m)]  # and nothing else patched
    assert patched == [hooked.model.norm] and not tk_hf.is_applied(hooked)
    q = torch.randn(1, HEADS, 4, 16, dtype=torch.bfloat16)
    kv = torch.randn(1, KV_HEADS, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="dropout"):
        tk_hf.attention_forward(model.model.layers[0].self_attn, q, kv, kv, None, dropout=0.1)


def _trainer_losses(model, out_dir) -> list[float]:
    """Two optimizer steps of HF's Trainer (AdamW, two micro-batches of one sequence accumulated a
    step, so the loss takes ``num_items_in_batch``), the logged loss of each."""
    ids, labels = _batch(batch=4)
    rows = [{"input_ids": ids[i], "labels": labels[i]} for i in range(len(ids))]
    args = transformers.TrainingArguments(
        output_dir=str(out_dir),
        max_steps=2,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.slow
def test_hf_trainer_trains_the_patched_model_as_the_unpatched_one(tmp_path):
    """Each step's loss under Trainer within the oracle's rule: the unpatched model trained in float64
    the reference, in bf16 torch's term (bf16: pure fp16 weights under AdamW overflow)."""
    pytest.importorskip("accelerate")
    base = _model("llama", torch.bfloat16)
    exact = _trainer_losses(copy.deepcopy(base).double(), tmp_path / "exact")
    plain = _trainer_losses(copy.deepcopy(base), tmp_path / "plain")
    ours = _trainer_losses(tk_hf.apply(copy.deepcopy(base)), tmp_path / "ours")
    assert len(ours) == len(exact) == 2
    for step, values in enumerate(zip(ours, plain, exact, strict=True)):
        ours_loss, plain_loss, exact_loss = (torch.tensor(v, dtype=torch.float64) for v in values)
        assert compare(f"loss {step}", ours_loss, plain_loss, exact_loss, torch.bfloat16).passed, values


# ---------------------------------------------------------------- FSDP2, two CPU processes on gloo


def _fsdp_results(out_dir: str, rank: int) -> dict:
    """A rank's step under fully_shard; rank 0 saves the loss and the gradients (averaged over the
    ranks) for the parent, which compares tensors, not JSON."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    model = tk_hf.apply(_model("llama", torch.float16)).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids, labels = _batch(batch=world)
    loss = model(input_ids=ids[rank : rank + 1], labels=labels[rank : rank + 1]).loss
    loss.backward()
    dist.all_reduce(loss)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}  # averaged over ranks
    if rank == 0:
        torch.save({"loss": loss / world, "grads": grads}, os.path.join(out_dir, "fsdp.pt"))
    return {}


@pytest.mark.slow
def test_fsdp2_trains_as_one_process(tmp_path):
    """A patched model under fully_shard on two gloo processes, a sequence each: the loss and every
    gradient (FSDP's average over the ranks) pass the oracle against the float64 model on the whole
    batch, with the patched model on one process as the torch term (each row keeps as many tokens,
    so the mean of the ranks' means is the whole batch's)."""
    gloo.run_ranks(functools.partial(_fsdp_results, str(tmp_path)), 2, 240, tmp_path, "FSDP2")
    sharded = torch.load(tmp_path / "fsdp.pt")
    ids, labels = _batch(batch=2)
    reference = _model("llama", torch.float16)
    exact = _train(copy.deepcopy(reference).double(), ids, labels)  # no logits: the ranks keep none
    one = _train(tk_hf.apply(copy.deepcopy(reference)), ids, labels)
    comparisons = [compare("loss", sharded["loss"], one[0], exact[0], torch.float16)]
    comparisons += [
        compare(f"grad {name}", grad, one[1][name], exact[1][name], torch.float16)
        for name, grad in sharded["grads"].items()
    ]
    assert len(comparisons) == 1 + len(exact[1])
    failed = [c for c in comparisons if not c.passed]
    assert not failed, failed
