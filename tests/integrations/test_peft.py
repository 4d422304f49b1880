"""LoRA through peft on a Llama whose frozen base lives on nvme: only the adapters train.

Against plain torch + peft, 5 steps, AdamW over the trainable parameters, within 1e-5 (the
fused kernel against torch's default: float rounding). The frozen base has no optimizer state
and is never written after initialize: each of its tensors in the swap space keeps generation
1, and the bytes a step writes are exactly the adapters' (gradients, optimizer state, params).
"""

import copy

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import infinity  # noqa: E402


def _lora_llama(layers: int = 2):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    base = transformers.LlamaForCausalLM(cfg)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, lora)
    for name, p in model.named_parameters():  # peft starts lora_B at zero; move off it to test more
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def test_lora_on_a_frozen_nvme_base_matches_plain_peft_and_never_writes_the_base(tmp_path):
    model = _lora_llama()
    ref = copy.deepcopy(model)
    cfg = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
           "nvme": {"paths": [str(tmp_path)], "grow_step": "4MiB"},
           "optimizer": {"lr": 1e-2, "weight_decay": 0.01}}  # fmt: skip
    engine = infinity.initialize(model, cfg)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    frozen = engine.optimizer.frozen
    trainable = [u for g in engine.optimizer.groups for u in g.units]
    assert frozen and trainable and all("lora_" in u.name for u in trainable)
    assert not any(u.name.endswith(f"/{k}") for u in frozen for k in ("master", "exp_avg"))
    names = set(engine.space.names())
    assert not any(f"{u.name}/master" in names or f"{u.name}/grad" in names for u in frozen)
    n = sum(u.shard_numel for u in trainable)
    engine.plan.held = 0  # every gradient written: the count below is exact
    # grads, master + moments, params (none beside the master weights with one copy of fp32)
    per_step = 4 * n + 3 * 4 * n + (0 if engine.optimizer.one_copy else engine.dtype.itemsize * n)
    for step in range(5):
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        assert abs(loss.item() - ref_loss.item()) < 1e-5
        if step > 0:  # the first step's counters also hold initialize's writes
            assert engine.stats()["step"]["nvme"]["write_bytes"] == per_step
    for u in frozen:
        assert engine.space.info(f"{u.name}/param").generation == 1, u.name  # written at initialize only
    got = engine.gathered_weights()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), atol=1e-5, rtol=0)
    engine.close()


@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non-reentrant"])
def test_backward_lets_go_of_the_frozen_base_as_it_goes(tmp_path, checkpointing):
    """A unit is released in backward when its last gradient arrives: the frozen base layers
    of a LoRA model get none, so every one backward fetched stayed bound to its end, and
    backward held the whole base in the host pool (an audit helper's repro: PoolExhausted
    in the first backward of a base twice the host budget, where the same model with every
    parameter trainable stepped). Now each is let go once its module's input has its
    gradient: when backward reaches the embeddings, the layers' frozen units are released
    (all 36 were bound), and the run still trains as plain peft."""
    model = _lora_llama(layers=4)
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.enable_input_require_grads()  # (as the Trainer does under gradient checkpointing with peft)
        if checkpointing is not None:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    engine = infinity.initialize(model, _nvme(tmp_path))
    layers = [u for u in engine.optimizer.frozen if ".layers." in u.name]
    bound = []

    def on_embeddings(module, args, out):
        out.register_hook(lambda grad: bound.append(sum(u.full is not None for u in layers)))

    model.get_input_embeddings().register_forward_hook(on_embeddings)
    model.train()
    ref.train()
    _trains_as_plain_peft(engine, ref, steps=3)
    # (At most layer 0's input norm, whose input is this very tensor: its hook runs after this one.)
    assert len(layers) == 36 and bound == [bound[0]] * 3 and bound[0] <= 1, bound
    engine.close()


def _plain_adamw(ref):
    """Plain torch's AdamW over ``ref``'s trainable parameters, at `_nvme`'s hyperparameters."""
    return torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)


def _step_as_plain_peft(engine, ref, opt, step: int) -> None:
    """One step of the engine and of plain peft (``ref`` with ``opt``) on the same batch: the same loss."""
    loss = engine(input_ids=_ids(step), labels=_ids(step)).loss
    engine.backward(loss)
    engine.step()
    ref_loss = ref(input_ids=_ids(step), labels=_ids(step)).loss
    opt.zero_grad()
    ref_loss.backward()
    opt.step()
    assert abs(loss.item() - ref_loss.item()) < 1e-5, (step, loss.item(), ref_loss.item())


def _trains_as_plain_peft(engine, ref, steps: int) -> None:
    """``steps`` steps of both (`_step_as_plain_peft`), then every weight of the engine's
    (adapters and frozen base) as plain peft's, to fp32 rounding."""
    opt = _plain_adamw(ref)
    for step in range(steps):
        _step_as_plain_peft(engine, ref, opt, step)
    got = engine.gathered_weights()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), atol=1e-5, rtol=0, msg=name)


def _tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _add_lora(model):
    torch.manual_seed(1)  # the adapters' draws (lora_A) from the same state on both paths
    return peft.get_peft_model(model, _lora_config())


def _nvme(tmp_path, name="swap"):
    (tmp_path / name).mkdir()
    return {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
            "nvme": {"paths": [str(tmp_path / name)], "grow_step": "4MiB"},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.01}}  # fmt: skip


def _ids(step):
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step))


def test_from_pretrained_with_wrap_streams_the_base_and_trains_the_adapters_as_plain_peft(tmp_path):
    """The streamed path: the base built on the meta device and read from the checkpoint into
    nvme, the adapters with peft's own initialisation (lora_B zeros, lora_A from its RNG).
    Against plain transformers + peft + torch AdamW, 3 steps, losses and adapters within 1e-5
    (fp32; the fused AdamW kernel against torch's default: float rounding)."""
    _tiny_llama().save_pretrained(tmp_path / "base")
    ref = _add_lora(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"))
    opt = _plain_adamw(ref)
    engine = infinity.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "base", _nvme(tmp_path),
                                      wrap=_add_lora)  # fmt: skip
    assert isinstance(engine.module, peft.PeftModel)
    start = engine.gathered_weights()
    adapters = [n for n, p in ref.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n in adapters)
    for name, p in ref.named_parameters():  # base from the checkpoint, adapters as peft made them
        assert torch.equal(start[name], p.detach()), name
    assert all(start[n].abs().sum() == 0 for n in adapters if "lora_B" in n)
    assert all(start[n].abs().sum() > 0 for n in adapters if "lora_A" in n)
    for step in range(3):
        _step_as_plain_peft(engine, ref, opt, step)
    got = engine.gathered_weights()
    for name in adapters:
        torch.testing.assert_close(got[name], ref.get_parameter(name).detach(), atol=1e-5, rtol=0)
        assert not torch.equal(got[name], start[name]), name  # trained
    engine.close()


def test_peft_on_the_module_of_a_live_engine_is_refused_at_the_next_forward_and_step(tmp_path):
    """Adapters added after initialize are nothing the engine manages: they never trained
    (lora_B stayed zero); now the next forward or step says to wrap before."""
    _tiny_llama().save_pretrained(tmp_path / "base")
    with infinity.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "base", _nvme(tmp_path)) as engine:
        wrapped = peft.get_peft_model(engine.module, _lora_config())
        with pytest.raises(RuntimeError, match=r"lora_A.default.weight' of engine.module is not one the engine "
                                               r"manages.*from_pretrained\(ModelClass, path, config, wrap=fn\)"):
            wrapped(input_ids=_ids(0), labels=_ids(0))
        with pytest.raises(RuntimeError, match="not one the engine manages"):
            engine.optimizer.step()


def test_peft_on_a_built_model_is_refused_at_initialize_not_initialised_as_the_base(tmp_path):
    """peft moves the adapters of a model built on the meta device there too: their own
    initialisation is gone, and the model's (lora_B normal, not zero) would train from it."""
    with infinity.build():
        model = _tiny_llama()
    wrapped = _add_lora(model)
    with pytest.raises(ValueError, match=r"lora_A.default.weight' is on the meta device but infinity.build did "
                                         r"not put it there.*wrap=fn"):
        infinity.initialize(wrapped, _nvme(tmp_path))


def test_a_wrapper_that_reads_the_base_weights_before_they_are_loaded_is_refused(tmp_path):
    """modules_to_save copies the base layer (its weights not loaded yet): refused, not zeros."""
    _tiny_llama().save_pretrained(tmp_path / "base")
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match="computed with the base parameter 'lm_head.weight'"):
        infinity.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "base", _nvme(tmp_path),
                                 wrap=lambda m: peft.get_peft_model(m, cfg))  # fmt: skip


def test_save_pretrained_of_a_peft_engine_is_refused_and_peft_s_own_writes_the_adapters(tmp_path):
    """engine.save_pretrained of a PeftModel wrote the wrapper's keys (base_model.model.*) under
    architectures ["PeftModel"]: AutoModelForCausalLM.from_pretrained loaded it as a randomly
    initialised model, saying so only in a load report. Refused, naming peft's own save, which
    writes the adapters as trained."""
    import safetensors.torch

    (tmp_path / "swap").mkdir()
    model = _lora_llama()
    cfg = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}, "nvme": {"paths": [str(tmp_path / "swap")]}}
    with infinity.initialize(model, cfg) as engine:
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        with pytest.raises(TypeError, match=r"PeftModel, not a transformers model.*engine.module.save_pretrained"):
            engine.save_pretrained(tmp_path / "out")
        assert not (tmp_path / "out").exists()
        engine.module.save_pretrained(tmp_path / "adapters")
        saved = safetensors.torch.load_file(tmp_path / "adapters" / "adapter_model.safetensors")
        weights = engine.gathered_weights()
    assert saved and all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in saved)
    for key, value in saved.items():
        live = key.removeprefix("base_model.model.").replace(".weight", ".default.weight")
        assert torch.equal(value, weights["base_model.model." + live] if "base_model.model." + live in weights
                           else weights[live]), key  # fmt: skip


@pytest.mark.parametrize("method", ["lora-embeddings", "ia3"])
def test_adapters_held_in_parameter_containers_train_as_plain_peft_on_nvme(tmp_path, method):
    """peft keeps LoRA's embedding adapters (``lora_embedding_A``) and IA3's vectors in
    ParameterDicts, which the layer reads in its own forward: with the parameters on nvme the
    first forward was refused, naming GatheredParameters, which peft gives no way to use (an
    audit helper's repro). They train as plain peft's now."""
    torch.manual_seed(1)
    if method == "ia3":
        adapters = peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    else:
        adapters = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(_tiny_llama(), adapters)
    for p in model.parameters():  # off peft's identity start, so that every adapter's gradient counts
        if p.requires_grad:
            torch.nn.init.normal_(p, mean=1.0 if method == "ia3" else 0.0, std=0.05)
    ref = copy.deepcopy(model)
    engine = infinity.initialize(model, _nvme(tmp_path))
    _trains_as_plain_peft(engine, ref, steps=3)
    engine.close()


def test_dora_is_refused_where_the_parameters_are_released_and_trains_where_they_are_not(tmp_path):
    """peft's DoRA reads its base layer's weight and its adapters' shapes in the LoRA layer's
    forward, outside the modules that hold them: with the parameters on nvme peft failed
    inside with an IndexError (an audit helper's repro). Refused at initialize, naming the
    layer and use_dora; with every tier on the device (here the host) it trains as plain peft."""
    def dora():
        torch.manual_seed(1)
        return peft.get_peft_model(_tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                                  lora_dropout=0.0, use_dora=True))  # fmt: skip

    with pytest.raises(ValueError, match=r"'base_model.model.model.layers.0.self_attn.q_proj' is a peft LoRA layer "
                                         r"with use_dora=True.*tiers.params = 'nvme'"):  # fmt: skip
        infinity.initialize(dora(), _nvme(tmp_path))
    model = dora()
    ref = copy.deepcopy(model)
    cfg = {"tiers": {"params": "device", "grads": "device", "optimizer": "device"},
           "optimizer": {"lr": 1e-2, "weight_decay": 0.01}}  # fmt: skip
    engine = infinity.initialize(model, cfg)
    _trains_as_plain_peft(engine, ref, steps=2)
    engine.close()


def test_disable_adapter_under_no_grad_gives_the_base_model_s_logits(tmp_path):
    """peft's disable_adapter() turns the adapters' requires_grad off around the forwards it
    runs (TRL's DPO, KTO and GRPO take their reference log-probabilities so, under no_grad):
    the engine refused that forward as a parameter frozen after initialize, on every tier (an
    audit helper's repro). Under no_grad it runs now, giving plain peft's base logits, and
    training goes on as plain peft's."""
    model = _lora_llama()
    ref = copy.deepcopy(model)
    engine = infinity.initialize(model, _nvme(tmp_path))
    opt = _plain_adamw(ref)
    for step in range(2):
        with torch.no_grad(), engine.module.disable_adapter():
            got = engine.module(input_ids=_ids(step)).logits
        with torch.no_grad(), ref.disable_adapter():
            want = ref(input_ids=_ids(step)).logits
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        _step_as_plain_peft(engine, ref, opt, step)
    engine.close()


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def test_the_trainer_saves_the_adapters_as_plain_peft_without_gathering_the_base(tmp_path, monkeypatch):
    """InfinityTrainer gave peft's save the whole model's state_dict at save_model and every
    checkpoint: the whole frozen base gathered into host memory (an audit helper's repro: 241
    MiB held for a 0.5 MiB adapter, at a host budget of 128 MiB). It gathers the keys peft
    keeps alone now (`integrations._peft`): the adapters, lm_head's modules_to_save copy and
    an inactive second adapter, written as plain Trainer writes them."""
    from safetensors.torch import load_file

    from infinity.integrations.transformers import InfinityTrainer

    def model():
        torch.manual_seed(1)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                 modules_to_save=["lm_head"])  # fmt: skip
        m = peft.get_peft_model(_tiny_llama(), config)
        m.add_adapter("second", peft.LoraConfig(r=2, target_modules=["k_proj"]))  # frozen: not the active one
        return m

    given = []
    save = transformers.Trainer._save
    monkeypatch.setattr(transformers.Trainer, "_save",
                        lambda self, output_dir=None, state_dict=None: (given.append(state_dict), save(self, output_dir, state_dict))[1])  # fmt: skip

    def run(cls, out, **kw):
        args = transformers.TrainingArguments(output_dir=str(out), max_steps=2, per_device_train_batch_size=2,
                                              learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no",
                                              disable_tqdm=True)  # fmt: skip
        trainer = cls(model=model(), args=args, train_dataset=_Tokens(), **kw)
        trainer.train()
        trainer.save_model()
        if trainer.__class__ is InfinityTrainer:
            trainer.engine.close()

    run(transformers.Trainer, tmp_path / "plain")
    run(InfinityTrainer, tmp_path / "ours", infinity_config=_nvme(tmp_path))
    ours = given[-1]
    assert ours and all(("lora_" in k or "modules_to_save" in k) for k in ours), sorted(ours)
    for sub in ("", "second"):
        want = load_file(str(tmp_path / "plain" / sub / "adapter_model.safetensors"))
        got = load_file(str(tmp_path / "ours" / sub / "adapter_model.safetensors"))
        assert want.keys() == got.keys() and want
        for key in want:
            torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0, msg=key)
