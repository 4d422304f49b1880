"""A plain accelerate loop over engine.module and engine.optimizer, against the same loop in plain torch.

Where the plain loop calls ``accelerator.clip_grad_norm_(model.parameters(), ...)``, the engine's
loop calls ``engine.clip_grad_norm_``: the parameters have no ``.grad`` (the gradients are in
the tiers), and the module is prepared without DDP (the README's recipe; at several processes
see test_multirank_frameworks.py). Losses within 1e-5 (fused AdamW against torch's default
kernel: rounding).
"""

import logging

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import infinity  # noqa: E402


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _data():
    ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=2)


def _loop(model, optimizer, clip, engine=None):
    accelerator = accelerate.Accelerator(cpu=True)
    if engine is None:
        model, optimizer, data = accelerator.prepare(model, optimizer, _data())
    else:  # the README's recipe: no DDP around engine.module at several processes
        model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        optimizer, data = accelerator.prepare(optimizer, _data())
    losses = []
    for batch in data:
        loss = model(**batch).loss
        accelerator.backward(loss)
        clip(accelerator, model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_an_accelerate_loop_on_nvme_matches_plain_torch(tmp_path):
    ref = _llama()
    want = _loop(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1),
                 lambda acc, m: acc.clip_grad_norm_(m.parameters(), 0.5))  # fmt: skip
    model = _llama()
    cfg = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
           "nvme": {"paths": [str(tmp_path)], "grow_step": "4MiB"}}  # fmt: skip
    engine = infinity.initialize(model, cfg, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1))
    got = _loop(engine.module, engine.optimizer, lambda acc, m: engine.clip_grad_norm_(0.5), engine)
    assert len(got) == len(want) == 8
    assert all(abs(a - b) < 1e-5 for a, b in zip(got, want)), list(zip(got, want))
    engine.close()


@pytest.fixture
def fresh_accelerate_state():
    """An Accelerator's mixed precision is the process's (AcceleratorState is shared): the
    test's bf16 must not reach the tests after it."""
    accelerate.state.AcceleratorState._reset_state(True)
    yield
    accelerate.state.AcceleratorState._reset_state(True)


@pytest.mark.parametrize("prepared", ["engine", "engine.module"])
def test_bf16_mixed_precision_that_misses_the_engine_is_said(prepared, fresh_accelerate_state, recwarn):
    """accelerator.prepare(engine, ...) gives the engine back as it is (it is no nn.Module):
    its forward ran in fp32 under mixed_precision="bf16", silently (the fp32 loop's logits,
    not the bf16 loop's). It is said at its call; the README's recipe, which prepares
    engine.module, runs under accelerate's autocast and says nothing."""
    model = _llama()
    engine = infinity.initialize(model, {}, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))
    try:
        batch = next(iter(_data()))
        with torch.no_grad():
            fp32 = engine(**batch).logits  # before any Accelerator: nothing to say
        accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
        if prepared == "engine":
            wrapped, _ = accelerator.prepare(engine, engine.optimizer)
            assert wrapped is engine
        else:
            wrapped = accelerator.prepare_model(engine.module, device_placement=False, evaluation_mode=True)
        with torch.no_grad():
            logits = wrapped(**batch).logits
            logits_again = wrapped(**batch).logits
        said = [w for w in recwarn if "this engine's forward runs without it" in str(w.message)]
        if prepared == "engine":
            assert torch.equal(logits, fp32)  # what ran: the fp32 forward
            assert len(said) == 1 and "prepare_model(engine.module" in str(said[0].message)  # once
            with torch.no_grad(), accelerator.autocast():  # what it names: the call under accelerate's autocast
                assert not torch.equal(engine(**batch).logits, fp32)
        else:
            assert not said
            assert not torch.equal(logits, fp32)  # accelerate's bf16 autocast ran
        assert torch.equal(logits_again, logits)
    finally:
        engine.close()


def test_an_optimizer_prepared_before_initialize_is_refused_naming_the_order(tmp_path, fresh_accelerate_state):
    """accelerator.prepare(model, opt) then initialize(model, optimizer=opt) with offloaded
    state: the refusal named an unknown class "AcceleratedOptimizer" and the classes the engine
    runs, not the AdamW inside it nor the order that works (audit A)."""
    model = _llama()
    accelerator = accelerate.Accelerator(cpu=True)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=3e-3))
    cfg = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}, "nvme": {"paths": [str(tmp_path)]}}
    with pytest.raises(ValueError, match=r"AcceleratedOptimizer cannot run on offloaded state.*wraps AdamW.*"
                                         r"before it is prepared, then prepare engine.optimizer"):  # fmt: skip
        infinity.initialize(model, cfg, optimizer=optimizer)


def test_accelerates_save_state_says_it_cannot_resume_the_optimizer(tmp_path, fresh_accelerate_state, caplog):
    """accelerator.save_state saved the engine's optimizer state_dict (its groups and step
    counts, no moments: those are in the tiers) without a word, and load_state refused it: a
    whole run's checkpoints found unusable at the resume (audit A). The save says so now, once;
    the prepare, whose state_dict round trip has no steps to lose, says nothing."""
    model = _llama()
    cfg = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}, "nvme": {"paths": [str(tmp_path / "swap")]}}
    (tmp_path / "swap").mkdir()
    engine = infinity.initialize(model, cfg, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))
    try:
        accelerator = accelerate.Accelerator(cpu=True)
        prepared = accelerator.prepare_model(engine.module, device_placement=False, evaluation_mode=True)
        with caplog.at_level(logging.WARNING, logger="infinity"):
            optimizer = accelerator.prepare(engine.optimizer)
            assert "not the optimizer states" not in caplog.text
            batch = next(iter(_data()))
            accelerator.backward(prepared(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
            accelerator.save_state(str(tmp_path / "state"))
            accelerator.save_state(str(tmp_path / "state2"))
        assert caplog.text.count("not the optimizer states") == 1
        assert "engine.save_checkpoint" in caplog.text
        accelerator.backward(prepared(**batch).loss)
        optimizer.step()  # a step on: the saved counts are no longer the engine's
        optimizer.zero_grad()
        with pytest.raises(ValueError, match="engine.load_checkpoint"):  # what it warned of
            accelerator.load_state(str(tmp_path / "state"))
    finally:
        engine.close()
