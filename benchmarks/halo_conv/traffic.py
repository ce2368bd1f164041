"""Memory traffic beyond the local op's, per layer and per pass: a stack of L x (Conv(C->C, k3, padding 1) + ReLU)
split on the first spatial dim over N Gloo ranks, profiled once sharded and once as the same layers on each rank's
own rows without communication (local-only); the difference is what domain parallelism adds. `--layer na`: the
layers are 2-D neighbourhood attention (q = k = v = the input laid out [B, H, W, heads, C/heads], kernel 7) + ReLU;
`--layer interp`: interpolation (`--mode`, scale 2 then 0.5, alternating) + ReLU; `--layer tconv`: a transposed
convolution (k4, stride 2: up) then a strided one (k4, stride 2: down), alternating, + ReLU.

Traffic of a kernel (the profiler's list of aten ops that do the work, not their composite callers) is counted as the
bytes it writes: what it allocates for its results (the profiler's memory accounting) and, for an in-place kernel
(copy_, add_, zero_, fill_, index_add_, ...), the size of the tensor it writes (its first input). Reads are not
counted: an op on a ShardTensor is recorded with the global shapes of its arguments, not the local ones its kernel
reads. Attributed to the layer whose forward (a record_function around the
module) or backward (a range opened by the module's backward pre-hook and closed by its backward hook) encloses it.
The goal (issue 28): the extra traffic of a layer is the halo rows -- per pass, a few rows of C x W per neighbour --
not a pass over the rank's whole block. Reported per rank 0 (rank 1 is its mirror image).

    .venv/bin/python benchmarks/halo_conv/traffic.py [--ranks 2] [--size 256] [--dims 2] [--channels 16] [--layers 4]
        [--layer conv|na|interp|tconv] [--kernel 7] [--mode bilinear] [--mesh 2x2]
"""
from __future__ import annotations

import argparse
import collections
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import shardtensor as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_util import init_cpu_rank, spawn_rank0_rows, write_rank0_rows, write_report  # noqa: E402
from results_dir import add_out_argument, git, loadavg, prepare  # noqa: E402

ELEMENT_BYTES = 4   # the profiler records shapes, not dtypes; everything here is float32 (index tensors are tiny)


class NeighborhoodAttention(nn.Module):
    """q = k = v = the input ([B, spatial..., heads, head_dim]): the op alone, no projections."""
    def __init__(self, dims: int, kernel: int):
        super().__init__()
        self.dims, self.kernel = dims, kernel

    def forward(self, x):
        from shardtensor.ops import neighborhood_attention
        return neighborhood_attention(x, x, x, [self.kernel] * self.dims)


class Interpolate(nn.Module):
    def __init__(self, scale: float, mode: str):
        super().__init__()
        self.scale, self.mode = scale, mode

    def forward(self, x):
        mode, ac = (self.mode[:-3], True) if self.mode.endswith("-ac") else (self.mode, False)
        kw = {} if mode in ("nearest", "nearest-exact") else dict(align_corners=ac)
        return nn.functional.interpolate(x, scale_factor=self.scale, mode=mode, **kw)


def stack(dims: int, channels: int, layers: int, layer: str = "conv", kernel: int = 7,
          mode: str = "bilinear") -> nn.Module:
    conv = nn.Conv2d if dims == 2 else nn.Conv3d
    mods = []
    for i in range(layers):
        if layer == "conv":
            op = conv(channels, channels, 3, padding=1)
        elif layer == "na":
            op = NeighborhoodAttention(dims, kernel)
        elif layer == "tconv":   # up by a transposed convolution, then down by a strided one
            up = (nn.ConvTranspose2d if dims == 2 else nn.ConvTranspose3d)
            op = (up(channels, channels, 4, stride=2, padding=1) if i % 2 == 0
                  else conv(channels, channels, 4, stride=2, padding=1))
        else:
            op = Interpolate(2.0 if i % 2 == 0 else 0.5, mode)
        mods += [op, nn.ReLU()]
    return nn.Sequential(*mods)


def label_layers(net: nn.Module):
    """Forward and backward ranges named `layer i fwd` / `layer i bwd` around every layer's op (with its ReLU)."""
    open_ranges = {}
    convs = [m for m in net if not isinstance(m, nn.ReLU)]
    relus = [m for m in net if isinstance(m, nn.ReLU)]
    for i, (c, r) in enumerate(zip(convs, relus)):
        def fwd_pre(_m, _a, i=i):
            open_ranges[("fwd", i)] = torch.profiler.record_function(f"layer {i} fwd")
            open_ranges[("fwd", i)].__enter__()

        def fwd_post(_m, _a, _o, i=i):
            open_ranges.pop(("fwd", i)).__exit__(None, None, None)

        def bwd_pre(_m, _g, i=i):   # on the ReLU: the layer's backward starts with it
            open_ranges[("bwd", i)] = torch.profiler.record_function(f"layer {i} bwd")
            open_ranges[("bwd", i)].__enter__()

        def bwd_post(_m, _gi, _go, i=i):  # on the convolution: its input gradient ends the layer's backward
            r = open_ranges.pop(("bwd", i), None)
            if r is not None:
                r.__exit__(None, None, None)
        c.register_forward_pre_hook(fwd_pre)
        r.register_forward_hook(fwd_post)
        r.register_full_backward_pre_hook(bwd_pre)
        c.register_full_backward_hook(bwd_post)


def tensor_bytes(shapes) -> int:
    total = 0
    for shape in shapes:
        if isinstance(shape, list) and shape and all(isinstance(s, int) for s in shape):
            n = 1
            for s in shape:
                n *= s
            total += n * ELEMENT_BYTES
    return total


# In-place ops that only change metadata (no data written).
METADATA = {"aten::" + n for n in ("as_strided", "view", "alias", "narrow", "slice", "select", "expand", "permute",
                                   "transpose", "t", "unsqueeze", "squeeze", "_reshape_alias", "detach", "reshape",
                                   "unfold", "movedim", "split", "chunk", "unbind", "empty", "empty_strided",
                                   "empty_like", "resize_", "lift_fresh", "_unsafe_view", "flatten", "unflatten",
                                   "set_", "is_same_size", "size", "stride", "_local_scalar_dense", "result_type")}
DEBUG = os.environ.get("TRAFFIC_DEBUG", "")


def traffic_by_layer(prof) -> dict:
    """{'layer i fwd'/'layer i bwd': {'bytes': ..., 'ops': {name: bytes}}} over the leaf aten ops."""
    out = collections.defaultdict(lambda: {"bytes": 0, "ops": collections.Counter()})
    for e in prof.events():
        if not e.name.startswith("aten::") or e.cpu_children:
            continue
        owner, p = None, e.cpu_parent
        while p is not None:
            if p.name.startswith("layer "):
                owner = p.name
                break
            p = p.cpu_parent
        if owner is None:
            continue
        in_place = e.name.endswith("_") and e.name not in METADATA and e.input_shapes
        b = max(e.cpu_memory_usage, 0) + (tensor_bytes(e.input_shapes[:1]) if in_place else 0)
        if DEBUG and owner == DEBUG:
            print(owner, e.name, e.input_shapes, e.cpu_memory_usage, [p.name for p in [e.cpu_parent] if p], flush=True)
        out[owner]["bytes"] += b
        out[owner]["ops"][e.name] += b
    return {k: {"bytes": v["bytes"], "ops": dict(v["ops"])} for k, v in out.items()}


def mesh_shape(args):
    return tuple(int(e) for e in args.mesh.split("x")) if args.mesh else (args.ranks,)


def run_rank(rank, world, port, out_path, args):
    shape = mesh_shape(args)
    mesh = init_cpu_rank(rank, world, port, mesh_shape=shape, mesh_dim_names=[f"d{i}" for i in range(len(shape))])
    torch.manual_seed(0)
    net = stack(args.dims, args.channels, args.layers, args.layer, args.kernel, args.mode)
    label_layers(net)
    if args.layer == "na":   # [B, spatial..., heads, head_dim]: the first spatial dim is dim 1
        heads = max(1, args.channels // 8)
        x = torch.randn((1,) + (args.size,) * args.dims + (heads, args.channels // heads))
        split = 1
    else:
        x = torch.randn((1, args.channels) + (args.size,) * args.dims)
        split = 2
    sharded = st.distribute_tensor(x, mesh, [st.Shard(split + i) for i in range(len(shape))])
    inputs = {"sharded": sharded, "local": st.to_local(sharded).clone()}
    result = {}
    for name, inp in inputs.items():
        leaf = inp.detach().requires_grad_(True)
        for _ in range(2):   # warm-up: plans and caches built
            net.zero_grad(set_to_none=True)
            net(leaf).square().mean().backward()
        net.zero_grad(set_to_none=True)
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                    profile_memory=True) as prof:
            net(leaf).square().mean().backward()
        result[name] = traffic_by_layer(prof)
        result[name + "_rows"] = st.to_local(inp).shape[split] if name == "sharded" else inp.shape[split]
        result[name + "_block"] = list((st.to_local(inp) if name == "sharded" else inp).shape)
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    write_rank0_rows(rank, gathered, out_path)
    dist.destroy_process_group()


def render(ranks_data, meta) -> str:
    r0 = ranks_data[0]
    mesh = meta.get("mesh") or [meta["ranks"]]
    # One row of the rank's block along the first split dim (one sample, float32): C x its local extents.
    row_bytes = meta["channels"] * meta["size"] ** (meta["dims"] - 1) * 4
    if len(mesh) > 1 and "sharded_block" in r0:
        row_bytes = 4
        for e in r0["sharded_block"][1:]:
            row_bytes *= e
        row_bytes //= r0["sharded_block"][1 if meta.get("layer") == "na" else 2]   # the first split dim
    split_text = ("split on the first spatial dim" if len(mesh) == 1 else
                  f"mesh {'x'.join(map(str, mesh))} splitting the first {len(mesh)} spatial dims "
                  f"(rank 0's block {r0.get('sharded_block')})")
    layer = {"conv": "Conv(C→C, k3, padding 1)",
             "na": f"neighbourhood attention (q = k = v, kernel {meta.get('kernel')}, C = heads × head_dim)",
             "interp": f"interpolate ({meta.get('mode')}, scale 2 then 0.5)",
             "tconv": "ConvTranspose(C→C, k4, stride 2, padding 1) then Conv(C→C, k4, stride 2, padding 1)",
             }[meta.get("layer", "conv")]
    lines = [f"# Memory traffic beyond the local op's, per layer and pass ({meta['ranks']} Gloo CPU ranks)", "",
             f"{meta['layers']} × ({layer} + ReLU), C = {meta['channels']}, {meta['dims']}-D "
             f"{meta['size']}^{meta['dims']}, {split_text}; rank 0 "
             f"({r0['sharded_rows']} own rows; one row = {row_bytes / 1024:.1f} KiB). torch {meta['torch']}, commit "
             f"{meta['commit']}, {meta['date']}, load {meta['load']}. Command: `{meta['command']}`.", "",
             "Traffic: bytes every leaf aten op writes (its allocations, and the tensor an in-place op writes); "
             "*extra* = sharded − local-only on the same rows, in rows of C × W (a halo row exchanged is written a "
             "few times: packed, received, its border output). A full pass over the block would be "
             f"{r0['sharded_rows']} rows.", "",
             "| layer | pass | local-only MiB | sharded MiB | extra MiB | extra in rows | largest extra ops |",
             "|---|---|---|---|---|---|---|"]
    keys = sorted(set(r0["local"]) | set(r0["sharded"]), key=lambda k: (k.split()[2], int(k.split()[1])))
    for k in keys:
        loc = r0["local"].get(k, {"bytes": 0, "ops": {}})
        sh = r0["sharded"].get(k, {"bytes": 0, "ops": {}})
        extra = sh["bytes"] - loc["bytes"]
        diffs = collections.Counter({op: b - loc["ops"].get(op, 0) for op, b in sh["ops"].items()})
        top = ", ".join(f"{op.removeprefix('aten::')} {b / 2**20:.2f}" for op, b in diffs.most_common(3) if b > 0)
        lines.append(f"| {k.split()[1]} | {k.split()[2]} | {loc['bytes'] / 2**20:.2f} | {sh['bytes'] / 2**20:.2f} | "
                     f"{extra / 2**20:.2f} | {extra / row_bytes:.1f} | {top} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dims", type=int, default=2, choices=(2, 3))
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--mesh", default="", help="a mesh shape such as 2x2: its dims split the first spatial dims "
                    "(conv, tconv and na; overrides --ranks)")
    ap.add_argument("--layer", default="conv", choices=("conv", "na", "interp", "tconv"))
    ap.add_argument("--kernel", type=int, default=7, help="neighbourhood attention's kernel size")
    ap.add_argument("--mode", default="bilinear", help="interpolation mode (a suffix -ac: align_corners=True)")
    add_out_argument(ap)
    args = ap.parse_args()
    prepare(args.out)
    if args.mesh:
        if args.layer not in ("conv", "tconv", "na"):
            ap.error("--mesh: conv, tconv and na layers only")
        args.ranks = 1
        for e in mesh_shape(args):
            args.ranks *= e
    name = f"halo_conv_traffic_{args.dims}d_{args.size}" + (f"_mesh{args.mesh}" if args.mesh else "")
    if args.layer != "conv":
        name = f"halo_{args.layer}{'_' + args.mode if args.layer == 'interp' else ''}_traffic_{args.dims}d_{args.size}"
        name += f"_mesh{args.mesh}" if args.mesh else ""
    load = loadavg()
    data = spawn_rank0_rows(run_rank, args.ranks, os.path.join(args.out, f".{name}.json"), args)
    meta = dict(ranks=args.ranks, mesh=list(mesh_shape(args)), dims=args.dims, size=args.size, channels=args.channels, layers=args.layers,
                layer=args.layer, kernel=args.kernel, mode=args.mode,
                torch=torch.__version__, commit=git("rev-parse", "--short", "HEAD"),
                date=datetime.date.today().isoformat(), load=load,
                command="python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]))
    write_report(args.out, name, {"meta": meta, "ranks": data}, render(data, meta).rstrip("\n").split("\n"))


if __name__ == "__main__":
    main()
