import sys
def probe(keys, patterns=("first", "last", "middle")):
    import warnings
    import op_sweep
    from cases_util import mesh
    warnings.simplefilter("ignore")
    m = mesh()
    infos = op_sweep.float32_ops()
    out = []
    for k in keys:
        for p in patterns:
            info = infos[k]
            s = op_sweep._sample(info, p)
            if s is None:
                out.append(f"{k} {p}: n/a"); continue
            try:
                r = op_sweep._run(info, s, p, m, strict=True)
                out.append(f"{k} {p}: {r}")
            except Exception as e:
                msg = str(e).split("\n")[0][:300]
                out.append(f"{k} {p}: {type(e).__name__}: {msg}")
    return out
if __name__ == "__main__":
    sys.path.insert(0, "tests/python")
    import harness, _probe
    try:
        res = harness.run(2, _probe.probe, sys.argv[1].split(","))
        for line in res[0]: print(line)
    finally:
        harness.close_all()


def hprobe():
    import torch, shardtensor as st
    from cases_util import mesh, tiny_extents
    m = mesh()
    v = torch.randint(0, 9, (13,), generator=torch.Generator().manual_seed(3))
    vs = st.distribute_tensor(v, m, [st.Shard(0)], {0: tiny_extents(13, 3)})
    out = []
    for name, fn in [("plain", lambda t: torch.bincount(t)),
                     ("w", lambda t: torch.bincount(t, torch.linspace(0, 1, 13)))]:
        r = fn(vs)
        out.append((name, tuple(r.to_local().shape), str(r.to_local().dtype), st.sharding_shapes(vs)))
    return out
