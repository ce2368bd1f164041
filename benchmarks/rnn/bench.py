"""nn.LSTM over a split sequence (shardtensor/rnn.py): what a training step costs in time and per-rank memory, at 1,
2 and 4 CPU ranks against one process.

A (B, T, F) float32 sequence through a 2-layer LSTM (and a bidirectional one), split along time (the ranks relay the
state: the recurrence is sequential, a unidirectional stack runs as a wavefront over its layers; memory divided)
and along batch (each rank runs its own sequences: time and memory divided). Per case: rank 0's collectives, the step's time (the slowest
rank) against one process running the whole sequence, and the per-rank peak memory against one process.

    .venv/bin/python benchmarks/rnn/bench.py [--out DIR] [--length 2048] [--batch 8] [--ranks 1,2,4]

DIR defaults to the git-ignored benchmarks/results/local; --out benchmarks/results updates the committed results
(from a clean tree only). Writes rnn.json and rnn.md.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys

import torch
import torch.distributed as dist

import shardtensor as st

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from bench_util import format_collectives as fmt  # noqa: E402
from bench_util import init_cpu_rank, reduce_over_ranks, spawn_rank0_rows, timed, write_rank0_rows  # noqa: E402
from bench_util import write_report  # noqa: E402
from results_dir import add_out_argument, git, prepare  # noqa: E402

FEATURES, HIDDEN = 32, 64


def models():
    torch.manual_seed(0)
    return [("LSTM 2 layers", torch.nn.LSTM(FEATURES, HIDDEN, num_layers=2, batch_first=True)),
            ("LSTM 2 layers, bidirectional", torch.nn.LSTM(FEATURES, HIDDEN, num_layers=2, batch_first=True,
                                                           bidirectional=True))]


def run(rank, world, port, out_path, batch, length):
    mesh = init_cpu_rank(rank, world, port)
    x = torch.randn(batch, length, FEATURES, generator=torch.Generator().manual_seed(1))
    rows = []
    for name, model in models():
        reference = copy.deepcopy(model)
        for split, dim in (("time", 1), ("batch", 0)):
            xs = st.distribute_tensor(x, mesh, [st.Shard(dim)]).requires_grad_()

            def step():
                out, _ = model(xs)
                out.square().mean().backward()

            with st.CommCounter() as cc:
                step()
            t_sharded = reduce_over_ranks(timed(step, warmup=1, iters=3))
            peak = st.peak_memory(step)
            peaks = [None] * world
            dist.all_gather_object(peaks, peak)
            single_t = single_peak = None
            if rank == 0:
                xr = x.clone().requires_grad_()

                def single():
                    out, _ = reference(xr)
                    out.square().mean().backward()

                single_t = timed(single, warmup=1, iters=3)
                single_peak = st.peak_memory(single)
            rows.append({"model": name, "split": split, "calls": cc.calls, "bytes": cc.bytes,
                         "seconds_sharded": t_sharded, "seconds_single": single_t, "peak_bytes_per_rank": peaks,
                         "single_peak_bytes": single_peak})
    write_rank0_rows(rank, rows, out_path)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_out_argument(ap)
    ap.add_argument("--length", type=int, default=2048, help="sequence length T")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ranks", default="1,2,4", help="world sizes to run")
    args = ap.parse_args()
    out = prepare(args.out)
    results = {world: spawn_rank0_rows(run, world, os.path.join(out, f".rnn_rank0_{world}.json"), args.batch,
                                       args.length)
               for world in [int(w) for w in args.ranks.split(",")]}
    commit = git("rev-parse", "--short", "HEAD")
    load = os.getloadavg()[0]
    command = f"python benchmarks/rnn/bench.py --length {args.length} --batch {args.batch} --ranks {args.ranks}"
    meta = {"command": command, "torch": torch.__version__, "commit": commit, "load_1min": load,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    lines = ["# nn.LSTM over a split sequence", "",
             f"A ({args.batch}, {args.length}, {FEATURES}) float32 sequence, `nn.LSTM({FEATURES}, {HIDDEN}, "
             "num_layers=2, batch_first=True)` (and bidirectional), split along time or batch over P Gloo ranks (one "
             f"intra-op thread each); a training step (forward, mean-square loss, backward). torch {torch.__version__}, "
             f"commit {commit}, {meta['date']}, 1-minute load {load:.1f} on 2 cores. Command: `{command}`. "
             "Collectives: rank 0's per step. Times: the median of 3, the slowest rank, against one process running "
             "the whole sequence. Along time the ranks run one after another (the recurrence is sequential) while each "
             "rank holds its rows' activations only; a unidirectional stack runs as a wavefront (a rank on layer l "
             "while the next is on layer l - 1: L + P - 1 steps of one layer over T / P rows), a bidirectional one "
             f"layer by layer; along batch both divide. With more ranks than the machine's {os.cpu_count()} cores the times are oversubscribed (the "
             "ranks share cores); the memory ratios are not.", ""]
    for world, res in results.items():
        lines += [f"## P = {world}", "", "| model | split | collectives per step | step sharded | one process | ratio "
                  "| peak per rank / one process |", "|---|---|---|---|---|---|---|"]
        for r in res:
            peak = max(r["peak_bytes_per_rank"]) / r["single_peak_bytes"]
            lines.append(f"| {r['model']} | {r['split']} | {fmt(r['calls'], r['bytes'])} | "
                         f"{r['seconds_sharded'] * 1e3:.1f} ms | {r['seconds_single'] * 1e3:.1f} ms | "
                         f"{r['seconds_sharded'] / r['seconds_single']:.2f} | {peak:.2f} |")
        lines.append("")
    write_report(out, "rnn", {"meta": meta, "results": results}, lines)


if __name__ == "__main__":
    main()
