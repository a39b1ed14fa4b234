"""``actor.optimizer_impl=bf16_moments`` through the real checkpoint path, in-process on one rank:
the FSDP2 actor on the micro model, torch.distributed.checkpoint save and load (engine/fsdp.py's
``set_state_dict``, which ends in the optimizer's ``load_state_dict``). torch's load cast the
moments to the fp32 parameters' dtype, so after any resume they were fp32 for good."""

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from hybrid_rl.algorithms.losses import agg_weights, make_sft_loss
from hybrid_rl.batch import Sample, collate
from hybrid_rl.config import ActorConfig, ModelConfig
from hybrid_rl.engine.builders import build_policy_engine
from hybrid_rl.trainer.checkpoint import AppState, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.integration


def actor(ctx, micro_path):
    cfg = ActorConfig(lr=1e-2, micro_batch_size=4, optimizer_impl="bf16_moments")
    return build_policy_engine(micro_path, ModelConfig(attn_implementation="sdpa"), cfg, ctx, total_steps=10)


def moments(engine) -> dict[str, torch.Tensor]:
    names = {p: n for n, p in engine.module.named_parameters()}
    return {f"{names[p]}.{k}": v.to_local() if hasattr(v, "to_local") else v for p, st in engine.optimizer.state.items()
            for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")}  # fmt: skip


def test_moments_stay_bf16_through_a_dcp_save_and_resume(ctx, micro_path, tmp_path):
    trained = actor(ctx, micro_path)
    samples = [Sample([3, 4, 5 + i], [7 + i, 11, 13, 2], [0.0] * 4, [1] * 4, "stop", i) for i in range(4)]
    batch = collate(samples, 0)
    batch.loss_weights = agg_weights(batch.response_mask, "token-mean", float(batch.response_mask.sum()), float(batch.size))
    trained.train_batch(batch, make_sft_loss())
    path = save_checkpoint(tmp_path, 1, {"app": AppState(trained)}, {"step": 1}, keep_last=2, rank=0, world=1)
    resumed = actor(ctx, micro_path)
    load_checkpoint(path, {"app": AppState(resumed)}, rank=0)
    want, got = moments(trained), moments(resumed)
    assert want and sorted(got) == sorted(want)
    assert {str(t.dtype) for t in want.values()} == {"torch.bfloat16"}
    assert {n: str(t.dtype) for n, t in got.items() if t.dtype != torch.bfloat16} == {}
    assert all(torch.equal(got[n], want[n]) for n in want)
    resumed.train_batch(batch, make_sft_loss())  # and a step after the resume, then its checkpoint, stay bf16
    again = save_checkpoint(tmp_path, 2, {"app": AppState(resumed)}, {"step": 2}, keep_last=2, rank=0, world=1)
    meta = FileSystemReader(str(again)).read_metadata().state_dict_metadata
    saved = {k: str(m.properties.dtype) for k, m in meta.items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert saved and set(saved.values()) == {"torch.bfloat16"}, saved
