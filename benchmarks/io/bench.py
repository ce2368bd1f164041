"""Inputs read shard by shard (shardtensor.io): bytes each rank reads, against its slab and the whole file, and the
time, for .npy, HDF5 and zarr files of one array at 2 and 4 CPU ranks; the writers' bytes and time likewise.

    .venv/bin/python benchmarks/io/bench.py [--out DIR] [--size-mib 64] [--ranks 2,4]

Bytes are the process's own I/O counters (``rchar``/``wchar`` of /proc/self/io: every byte a read or write system
call moved, page cache included), taken around each call on each rank; loads run with ``check=False`` so no
collective's socket traffic is counted (writes synchronise through the process group, whose few hundred bytes per
barrier do count). The files sit in the page cache (they were just written), so the times are those of memory, not
of a disk. DIR defaults to the git-ignored benchmarks/results/local; --out benchmarks/results updates the
committed results (from a clean tree only). Writes io.json and io.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

import shardtensor as st

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from bench_util import timed  # noqa: E402
from results_dir import add_out_argument, loadavg, prepare  # noqa: E402

MiB = 1 << 20


def counters():
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


def counted(fn, key):
    """(bytes moved under ``key`` while ``fn`` ran, less the counters' own read)."""
    a, b = counters()[key], counters()[key]
    own = b - a if key == "rchar" else 0
    before = counters()[key]
    fn()
    return counters()[key] - before - own


def make_files(directory, shape, zarr_chunks):
    """The same float32 array as .npy, a contiguous HDF5 dataset and a zstd-compressed zarr array."""
    import h5py
    import zarr
    full = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    paths = {"npy": os.path.join(directory, "a.npy"), "hdf5": os.path.join(directory, "a.h5"),
             "zarr": os.path.join(directory, "a.zarr")}
    np.save(paths["npy"], full)
    with h5py.File(paths["hdf5"], "w") as f:
        f.create_dataset("a", data=full)
    z = zarr.create_array(store=paths["zarr"], shape=shape, dtype=full.dtype, chunks=zarr_chunks)
    z[...] = full
    return paths


def file_bytes(path):
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return os.path.getsize(path)


def loaders(paths):
    return {"npy": lambda m, pl: st.io.load_npy(paths["npy"], m, pl, check=False),
            "hdf5": lambda m, pl: st.io.load_hdf5(paths["hdf5"], "a", m, pl, check=False),
            "zarr": lambda m, pl: st.io.load_zarr(paths["zarr"], m, pl, check=False)}


def writers(directory):
    return {"npy": lambda x: st.io.save_npy(x, os.path.join(directory, "w.npy")),
            "hdf5": lambda x: st.io.save_hdf5(x, os.path.join(directory, "w.h5"), "a"),
            "zarr": lambda x: st.io.save_zarr(x, os.path.join(directory, "w.zarr"))}


def layouts(world):
    out = [("rows: Shard(0)", (world,), [st.Shard(0)]), ("columns: Shard(1)", (world,), [st.Shard(1)])]
    if world == 4:
        out += [("2x2: Shard(0), Shard(1)", (2, 2), [st.Shard(0), st.Shard(1)]),
                ("2x2: Replicate(), Shard(0)", (2, 2), [st.Replicate(), st.Shard(0)])]
    return out


def run(rank, world, port, out_path, paths, scratch):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import h5py  # noqa: F401  (imported before any counting)
    import zarr  # noqa: F401
    meshes = {}
    rows = []
    for name, mesh_shape, placements in layouts(world):
        if mesh_shape not in meshes:
            names = ("domain",) if len(mesh_shape) == 1 else ("a", "b")
            meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        m = meshes[mesh_shape]
        for fmt, load in loaders(paths).items():
            load(m, placements)  # warm-up: imports, metadata caches
            box = {}
            read = counted(lambda: box.setdefault("x", load(m, placements)), "rchar")
            seconds = timed(lambda: load(m, placements), warmup=0, iters=3)
            x = box["x"]
            slab = x.to_local().numel() * x.element_size()
            dist.barrier()
            written = counted(lambda: writers(scratch)[fmt](x), "wchar")
            write_seconds = timed(lambda: writers(scratch)[fmt](x), warmup=0, iters=2)
            rows.append({"layout": name, "format": fmt, "slab": slab, "read": read, "load_s": seconds,
                         "written": written, "save_s": write_seconds})
            dist.barrier()
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(everyone, f)
    dist.destroy_process_group()


def whole_file_times(paths):
    """One process reading the whole array (what every rank would read without slab reads)."""
    import h5py
    import zarr

    def h5():
        with h5py.File(paths["hdf5"], "r") as f:
            return f["a"][...]

    fns = {"npy": lambda: np.load(paths["npy"]), "hdf5": h5,
           "zarr": lambda: zarr.open_array(paths["zarr"], mode="r")[...]}
    return {fmt: timed(fn, warmup=1, iters=3) for fmt, fn in fns.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_out_argument(ap)
    ap.add_argument("--size-mib", type=int, default=64, help="array size (float32, square)")
    ap.add_argument("--ranks", default="2,4", help="world sizes to run")
    args = ap.parse_args()
    out = prepare(args.out)
    n = int(round((args.size_mib * MiB / 4) ** 0.5))
    shape = (n, n)
    zarr_chunks = (n // 16, n)
    load_start = loadavg()
    work = tempfile.mkdtemp(prefix="shardtensor_io_bench_")
    try:
        paths = make_files(work, shape, zarr_chunks)
        sizes = {fmt: file_bytes(p) for fmt, p in paths.items()}
        whole = whole_file_times(paths)
        results = {}
        for world in [int(w) for w in args.ranks.split(",")]:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            tmp = os.path.join(out, f".io_{world}.json")
            scratch = os.path.join(work, f"out{world}")
            os.makedirs(scratch)
            mp.spawn(run, args=(world, port, tmp, paths, scratch), nprocs=world, join=True)
            with open(tmp) as f:
                results[world] = json.load(f)
            os.remove(tmp)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    command = f"python benchmarks/io/bench.py --size-mib {args.size_mib} --ranks {args.ranks}"
    meta = {"command": command, "torch": torch.__version__, "commit": commit, "shape": list(shape),
            "zarr_chunks": list(zarr_chunks), "file_bytes": sizes, "whole_file_load_s": whole,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "loadavg": [load_start, loadavg()], "cpus": os.cpu_count()}
    with open(os.path.join(out, "io.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    lines = ["# Inputs read shard by shard (`shardtensor.io`)", "",
             f"Command: `{command}`. torch {torch.__version__}, commit {commit}, {meta['date']}, {os.cpu_count()} "
             f"CPUs (load average {load_start[0] if load_start else '?'} at start). One float32 array "
             f"{shape[0]} x {shape[1]} ({shape[0] * shape[1] * 4 / MiB:.0f} MiB) as .npy, a contiguous HDF5 dataset "
             f"and a zarr array (chunks {zarr_chunks[0]} x {zarr_chunks[1]}, zstd); file sizes "
             + ", ".join(f"{k} {v / MiB:.1f} MiB" for k, v in sizes.items()) + ".", "",
             "Per rank: *slab* is what the rank holds, *read* what its process read (`rchar` of /proc/self/io around "
             "one load, `check=False`), *read/slab* their ratio, the largest over the ranks; times are the slowest "
             "rank's median of 3 loads from the page cache. *Written* is `wchar` around one save (the barriers' "
             "socket bytes included; ranks holding replicated copies write nothing). One process reading the whole "
             "file (what each rank would read to slice its shard, or rank 0 to `scatter_tensor` it): "
             + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in whole.items()) + ".", ""]
    for world, per_rank in results.items():
        lines += [f"## P = {world}", "",
                  "| layout | format | slab per rank | read per rank | read/slab (max) | read/file | load time | "
                  "written per rank | save time |", "|---|---|---|---|---|---|---|---|---|"]
        for i, row in enumerate(per_rank[0]):
            ranks = [rows[i] for rows in per_rank]
            slabs = [r["slab"] for r in ranks]
            reads = [r["read"] for r in ranks]
            writes = [r["written"] for r in ranks]
            ratio = max(r["read"] / r["slab"] for r in ranks if r["slab"])
            lines.append(
                f"| {row['layout']} | {row['format']} | {min(slabs) / MiB:.1f}-{max(slabs) / MiB:.1f} MiB | "
                f"{min(reads) / MiB:.2f}-{max(reads) / MiB:.2f} MiB | {ratio:.3f} | "
                f"{max(reads) / sizes[row['format']]:.3f} | {max(r['load_s'] for r in ranks) * 1e3:.0f} ms | "
                f"{min(writes) / MiB:.2f}-{max(writes) / MiB:.2f} MiB | "
                f"{max(r['save_s'] for r in ranks) * 1e3:.0f} ms |")
        lines.append("")
    lines += ["Reading: .npy and HDF5 read their slab and the header (a few hundred bytes; HDF5's metadata a few "
              "KiB). Zarr reads and decompresses every chunk its slab intersects, whole: with row chunks, a rank "
              "holding columns reads all of them (read/file 1), so chunk along the dims you shard. Writing: each "
              "element is written once, by one rank; zarr's chunks follow the shards (see docs/python-api.md).", ""]
    with open(os.path.join(out, "io.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
