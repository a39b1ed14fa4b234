"""Diagnosis: where the agentic recipe's tool episodes go wrong, per checkpoint.

    python -m benchmarks.agentic_errors --models WARM_START,RUN/hf [--n 128] [--samples 4]

For the first ``--n`` held-out level-5 problems (``data.synth`` defaults with ``n_val`` 512, the
agentic recipe's held-out set), each model plays the two-turn episode the recipe rewards:
(1) the tool call, whose code must be ``print(a * b)`` with the question's two numbers; (2) after
the real product comes back as the tool's output, the answer, which must box that product.
Greedy episodes are classed as ``wrong_code`` (turn 1 did not write the question's numbers),
``wrong_copy`` (right code, but the boxed answer is not the tool's output) or ``right``. With
``--samples K`` > 0 each problem is also sampled K times at ``--temperature`` (no top-k/top-p),
the tool output computed from whatever code was written, for the sampled accuracy (mean@K).

transformers' ``generate`` on one process: the same weights and chat template (tools offered:
``--tools``) as the vLLM engine, a different sampler, so sampled figures match the trainer's only
in distribution. Writes results/agentic_errors.json and .png.
"""

from __future__ import annotations

import argparse
import re

from benchmarks.common import figure, machine_info, save_figure, write_json

CODE = re.compile(r'"code": "print\((\d+) \* (\d+)\)"')


def episode(model, tok, tools, question: str, sample: bool, temperature: float) -> str:
    """One episode: "wrong_code", "wrong_copy" or "right"."""
    import torch

    def turn(messages: list[dict]) -> str:
        ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
        kw = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
        out = model.generate(torch.tensor([ids]), max_new_tokens=48, **kw)
        return tok.decode(out[0, len(ids) :], skip_special_tokens=True)

    user = {"role": "user", "content": question}
    call = turn([user])
    m = CODE.search(call)
    a, b = (int(x) for x in re.findall(r"\d+", question)[:2])
    if m is None or (int(m.group(1)), int(m.group(2))) != (a, b):
        return "wrong_code"
    answer = turn([user, {"role": "assistant", "content": call.strip()}, {"role": "tool", "content": str(a * b)}])
    return "right" if f"\\boxed{{{a * b}}}" in answer else "wrong_copy"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", required=True, help="comma-separated HF folders (a warm start, a run's hf/) or builtin:<preset>")
    ap.add_argument("--labels", default="", help="comma-separated names for the plot (default: the folders)")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--samples", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--tools", default="python,calculator", help="the tool names the recipe offers, in order")
    ap.add_argument("--name", default="agentic_errors")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybrid_rl.data.synth_math import generate_rows
    from hybrid_rl.models.tiny import tiny_model_path

    torch.manual_seed(0)
    tools = [{"type": "function", "function": {"name": n}} for n in args.tools.split(",")]
    problems = [r["prompt"][0]["content"] for r in generate_rows(512, "val", 0, [5])[: args.n]]
    paths = args.models.split(",")
    labels = args.labels.split(",") if args.labels else paths
    rows = []
    for label, given in zip(labels, paths, strict=True):
        # a bare preset (builtin:micro): the smoke test's untrained model
        path = str(tiny_model_path(given.removeprefix("builtin:"))) if given.startswith("builtin:") else given
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        greedy = [episode(model, tok, tools, q, False, 1.0) for q in problems]
        row = {"model": label, "path": path, "n": len(problems), **{k: greedy.count(k) for k in ("right", "wrong_code", "wrong_copy")}}
        if args.samples > 0:
            sampled = [episode(model, tok, tools, q, True, args.temperature) for q in problems for _ in range(args.samples)]
            row[f"mean@{args.samples}"] = sampled.count("right") / len(sampled)
            row["sampled_wrong_code"] = sampled.count("wrong_code") / len(sampled)
            row["sampled_wrong_copy"] = sampled.count("wrong_copy") / len(sampled)
        print(row, flush=True)
        rows.append(row)
    write_json(args.name, {"machine": machine_info(), "args": vars(args), "rows": rows})
    fig, ax = figure((6.5, 3.5))
    bottom = [0.0] * len(rows)
    for key, color in (("right", "tab:green"), ("wrong_copy", "tab:orange"), ("wrong_code", "tab:red")):
        vals = [r[key] / r["n"] for r in rows]
        ax.bar([r["model"] for r in rows], vals, bottom=bottom, color=color, label=key)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel(f"greedy episodes (first {args.n} held-out)")
    ax.legend(loc="lower right")
    save_figure(fig, args.name)


if __name__ == "__main__":
    main()
