"""AdamW with bf16 moments (engine/adamw_bf16.py): the AdamW update, unbiased rounding, state size."""

import io

import torch

from hybrid_rl.engine import adamw_bf16
from hybrid_rl.engine.adamw_bf16 import AdamWBf16Moments, round_bf16_stochastic
from hybrid_rl.engine.optim import OptimConfig, build_optimizer


def _pair(shape=(300, 70), lr=1e-2, wd=0.1, betas=(0.9, 0.999)):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(shape))
    b = torch.nn.Parameter(a.detach().clone())
    return (
        a,
        b,
        torch.optim.AdamW([a], lr=lr, betas=betas, weight_decay=wd),
        AdamWBf16Moments([b], lr=lr, betas=betas, weight_decay=wd),
    )


def test_first_step_is_torch_adamw_and_later_steps_stay_close(monkeypatch):
    """Step 1 updates from the unrounded fp32 moments, so it is torch's AdamW (weight decay, bias
    corrections, eps); later steps read the rounded moments and stay within bf16's error. Chunks
    smaller than the tensor check that every chunk is updated."""
    monkeypatch.setattr(adamw_bf16, "CHUNK", 999)
    a, b, ref, ours = _pair()
    for step in range(40):
        g = torch.randn_like(a) * (1 + step % 3)
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
        if step == 0:
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    assert (b - a).abs().max() < 0.02 * 40 * 1e-2  # under 2% of the largest possible travel (40 steps of lr)
    state = ours.state[b]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert int(state["step"]) == 40


def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours():
    x = torch.full((200_000,), 1.0 + 1 / 512)  # a quarter of the way from 1 to the next bf16 (1 + 1/128)
    out = torch.empty_like(x, dtype=torch.bfloat16)
    round_bf16_stochastic(x.clone(), out, torch.randint(0, 1 << 16, x.shape, dtype=torch.int32))
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 1 / 128}
    assert abs(out.float().mean().item() - (1.0 + 1 / 512)) < 2e-5
    special = torch.tensor([float("inf"), -float("inf"), 0.0, -2.5])
    out = torch.empty(4, dtype=torch.bfloat16)
    round_bf16_stochastic(special.clone(), out, torch.full((4,), (1 << 16) - 1, dtype=torch.int32))
    assert out.float().tolist() == [float("inf"), -float("inf"), 0.0, -2.5]


def test_second_moment_tracks_a_shrinking_gradient():
    """With b2 = 0.999, v changes by 0.1% a step, below bf16's resolution: rounded to nearest it
    would stay where it was; stochastically rounded it follows the fp32 moment. 3,000 steps after
    the gradient scale drops 10x, fp32 v has decayed ~20x."""
    a, b, ref, ours = _pair(shape=(4000,), lr=0.0, wd=0.0)
    for step in range(4000):
        g = torch.randn(4000) * (1.0 if step < 1000 else 0.1)
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    v_ref, v_ours = ref.state[a]["exp_avg_sq"].mean(), ours.state[b]["exp_avg_sq"].float().mean()
    assert v_ref < 0.1
    assert abs(v_ours / v_ref - 1) < 0.05, (v_ours, v_ref)


def test_build_optimizer_picks_the_kernel_and_halves_the_state():
    def state_bytes(impl: str) -> int:
        p = torch.nn.Parameter(torch.randn(64, 64))
        opt = build_optimizer([p], OptimConfig(1e-3, 0.0, (0.9, 0.999), 0, "constant", 1.0, 10, 1.0, impl))
        p.grad = torch.randn_like(p)
        opt.step()
        return sum(t.numel() * t.element_size() for t in opt.state[p].values() if t.dim())

    assert state_bytes("bf16_moments") * 2 == state_bytes("fused") == 2 * 64 * 64 * 4


def test_a_loaded_state_keeps_its_moments_in_bf16():
    """torch's ``Optimizer.load_state_dict`` casts floating state to the parameter's dtype: every
    resume turned the moments into fp32 (twice the memory, and fp32 in later checkpoints)."""
    _, b, _, ours = _pair(shape=(64, 32))
    for _ in range(3):
        b.grad = torch.randn_like(b)
        ours.step()
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)  # what a checkpoint holds, not the live tensors
    assert saved["state"][0]["exp_avg"].dtype == torch.bfloat16
    fresh = AdamWBf16Moments([b], lr=1e-2, weight_decay=0.1)
    fresh.load_state_dict(saved)
    got, want = fresh.state[b], ours.state[b]
    for key in ("exp_avg", "exp_avg_sq"):
        assert got[key].dtype == torch.bfloat16, (key, got[key].dtype)
        assert torch.equal(got[key], want[key]), key
    assert int(got["step"]) == 3
    b.grad = torch.randn_like(b)
    fresh.step()  # and it steps on from there, still bf16
    assert fresh.state[b]["exp_avg"].dtype == fresh.state[b]["exp_avg_sq"].dtype == torch.bfloat16
