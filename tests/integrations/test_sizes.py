"""transformers, peft, Trainer and accelerate read an engine's parameters' sizes and gradient norm.

Counts are compared with the same model's before initialize, exactly. accelerate's
``clip_grad_norm_`` over ``engine.module.parameters()`` is compared with the same loop in plain
torch: norms within 1e-4 relative and losses within 1e-5 (AdamW, the engine's fused kernel
against torch's default: rounding, as test_accelerate.py).
"""

import logging
import os
import sys

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from transformers.trainer_pt_utils import get_model_param_count  # noqa: E402

import infinity  # noqa: E402
from infinity.integrations.transformers import InfinityTrainer  # noqa: E402


sys.path.insert(0, os.path.dirname(__file__))
from test_transformers import _llama  # noqa: E402


def _nvme(tmp_path, **sections):
    (tmp_path / "swap").mkdir(exist_ok=True)
    return {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
            "nvme": {"paths": [str(tmp_path / "swap")], "grow_step": "4MiB"}, **sections}  # fmt: skip


def _counts(model):
    return (model.num_parameters(), model.num_parameters(only_trainable=True),
            model.num_parameters(exclude_embeddings=True), get_model_param_count(model, trainable_only=True),
            model.get_nb_trainable_parameters())  # fmt: skip


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_transformers_and_peft_count_what_the_model_had(tmp_path, capsys, dtype):
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    want = _counts(model)
    model.print_trainable_parameters()
    printed = capsys.readouterr().out
    engine = infinity.initialize(model, _nvme(tmp_path, precision={"param_dtype": dtype}))
    try:
        assert _counts(model) == want
        model.print_trainable_parameters()  # divided by 0 before
        assert capsys.readouterr().out == printed
    finally:
        engine.close()


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=8, length=16):
        self.ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out):
    return transformers.TrainingArguments(output_dir=str(out), max_steps=2, per_device_train_batch_size=2,
                                          report_to=[], use_cpu=True, seed=0, save_strategy="no",
                                          disable_tqdm=True)  # fmt: skip


def test_infinity_trainer_logs_the_count_and_flos_of_plain_trainer(tmp_path, caplog):
    log = transformers.utils.logging
    log.enable_propagation()
    level = log.get_verbosity()
    log.set_verbosity_info()
    try:
        with caplog.at_level(logging.INFO, logger="transformers.trainer"):
            plain = transformers.Trainer(model=_llama(), args=_args(tmp_path / "plain"), train_dataset=_Tokens())
            plain.train()
            ours = InfinityTrainer(model=_llama(), args=_args(tmp_path / "ours"), train_dataset=_Tokens(),
                                   infinity_config=_nvme(tmp_path))  # fmt: skip
            ours.train()
            ours.engine.close()
    finally:
        log.set_verbosity(level)
        log.disable_propagation()
    counts = [r.getMessage().strip() for r in caplog.records if "Number of trainable parameters" in r.getMessage()]
    n = _llama().num_parameters(only_trainable=True)
    assert len(counts) >= 2 and set(counts) == {f"Number of trainable parameters = {n:,}"}  # 0 before
    assert ours.state.total_flos == plain.state.total_flos > 0


def _data():
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=2)


def _loop(model, optimizer, engine=None):
    accelerator = accelerate.Accelerator(cpu=True)
    if engine is None:
        model, optimizer, data = accelerator.prepare(model, optimizer, _data())
    else:  # the README's recipe
        model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        optimizer, data = accelerator.prepare(optimizer, _data())
    out = []
    for batch in data:
        loss = model(**batch).loss
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        out.append((loss.item(), norm.item()))
    return out


def test_accelerator_clip_grad_norm_over_engine_module_clips_as_plain_torch(tmp_path):
    ref = _llama()
    want = _loop(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1))
    model = _llama()
    engine = infinity.initialize(model, _nvme(tmp_path), optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3,
                                                                                      weight_decay=0.1))  # fmt: skip
    try:
        got = _loop(engine.module, engine.optimizer, engine)
    finally:
        engine.close()
    assert len(got) == len(want) == 4
    assert all(n > 0.5 for _, n in want)  # every step clips
    for (loss, norm), (ref_loss, ref_norm) in zip(got, want):
        assert abs(loss - ref_loss) < 1e-5 and norm == pytest.approx(ref_norm, rel=1e-4), (got, want)
