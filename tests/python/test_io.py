"""shardtensor.io: inputs read shard by shard and outputs written shard by shard, on real files the tests write.

Every loader returns exactly ``distribute_tensor(full, mesh, placements, extents)`` (placements, extents, offsets,
local values) for uneven and zero extents, 1-4 ranks, a 2 x 2 mesh with two sharded dims and with a replicated
dim, C- and Fortran-ordered .npy, contiguous and chunked-compressed HDF5, zarr, and xarray over zarr and h5netcdf.
Each loader reads only its slab: counted in the process's I/O counters (.npy), through a counting Python file
object under h5py, and through a zarr store that records every chunk fetched. Writers write each element once
(copies on replicated mesh dims by one rank) and their files read back with the format's own library. Errors
(Partial, a wrong global_shape, a missing dataset, bad extents, a rank that cannot read) raise on every rank.
"""
import io
import os

import numpy as np
import pytest
import torch

import harness
import shardtensor as st
from cases_util import mesh, randn, tiny_extents, uneven_extents

SHAPE = (9, 7, 4)
BIG = (8, 16, 1024)                 # float32, 512 KiB: every Shard(0)/Shard(1) run is at least 4 KiB
LOADERS = ["npy", "npy_fortran", "hdf5", "hdf5_chunked", "zarr", "xarray_zarr", "xarray_h5netcdf"]
WRITERS = ["npy", "hdf5", "zarr"]
NEEDS = {"hdf5": ["h5py"], "hdf5_chunked": ["h5py"], "zarr": ["zarr"], "xarray_zarr": ["xarray", "zarr"],
         "xarray_h5netcdf": ["xarray", "h5netcdf"]}


def needs(fmt):
    for module in NEEDS.get(fmt.replace("_fortran", ""), []):
        pytest.importorskip(module, reason=f"{fmt}: {module} is not installed (optional: tests/requirements-zoo.txt)")


def full_values(shape=SHAPE, seed=21):
    return randn(*shape, seed=seed)


# ---- files, written in the pytest process with each format's own library ----

def write_file(fmt, directory, array, chunks=None):
    """The file holding ``array`` (dataset / array / variable "u"); returns its path."""
    base = os.path.join(str(directory), fmt)
    if fmt == "npy":
        np.save(base + ".npy", array)
        return base + ".npy"
    if fmt == "npy_fortran":
        np.save(base + ".npy", np.asfortranarray(array))
        return base + ".npy"
    if fmt in ("hdf5", "hdf5_chunked"):
        import h5py
        with h5py.File(base + ".h5", "w") as f:
            if fmt == "hdf5":
                f.create_dataset("fields/u", data=array)
            else:
                f.create_dataset("fields/u", data=array, chunks=chunks or (2, 3, 4), compression="gzip")
        return base + ".h5"
    if fmt == "zarr":
        import zarr
        z = zarr.create_array(store=base + ".zarr", name="u", shape=array.shape, dtype=array.dtype,
                              chunks=chunks or (2, 3, 4))
        z[...] = array
        return base + ".zarr"
    import xarray as xr
    ds = xr.Dataset({"u": (("z", "y", "x"), array)})
    if fmt == "xarray_zarr":
        ds.to_zarr(base + ".zarr", mode="w", encoding={"u": {"chunks": chunks or (2, 3, 4)}}, consolidated=False)
        return base + ".zarr"
    ds.to_netcdf(base + ".nc", engine="h5netcdf")
    return base + ".nc"


def load(fmt, source, m, placements, extents=None, **kwargs):
    if fmt.startswith("npy"):
        return st.io.load_npy(source, m, placements, extents, **kwargs)
    if fmt.startswith("hdf5"):
        return st.io.load_hdf5(source, kwargs.pop("dataset", "fields/u"), m, placements, extents, **kwargs)
    if fmt == "zarr":
        return st.io.load_zarr(source, m, placements, extents, name=kwargs.pop("name", "u"), **kwargs)
    engine = "zarr" if fmt == "xarray_zarr" else "h5netcdf"
    open_kwargs = {"consolidated": False} if engine == "zarr" else None
    return st.io.load_xarray(source, kwargs.pop("variable", "u"), m, placements, extents, engine=engine,
                             open_kwargs=open_kwargs, **kwargs)


def layouts(two_d):
    """(placements, extents) to load; uneven, zero (tiny_extents on 3+ ranks), negative dims, replicated."""
    if two_d:
        return [([st.Shard(0), st.Shard(1)], {0: uneven_extents(SHAPE[0], 2, 5), 1: tiny_extents(SHAPE[1], 2)}),
                ([st.Replicate(), st.Shard(1)], {1: [0, SHAPE[1]]}),
                ([st.Shard(2), st.Replicate()], None),
                ([st.Shard(1), st.Shard(0)], None)]
    w = mesh().size()
    return [([st.Shard(0)], None),
            ([st.Shard(1)], {0: uneven_extents(SHAPE[1], w, 3)}),
            ([st.Shard(0)], {0: tiny_extents(SHAPE[0], w)}),
            ([st.Shard(-1)], None),
            ([st.Replicate()], None)]


N_LAYOUTS = {False: 5, True: 4}   # len(layouts(two_d)), for the pytest process (which has no mesh)


def the_mesh(two_d):
    return mesh((2, 2), ("a", "b")) if two_d else mesh()


def check_same(y, ref, what):
    assert st.is_shard_tensor(y), what
    assert st.placements(y) == st.placements(ref), f"{what}: placements {st.placements(y)} != {st.placements(ref)}"
    assert st.sharding_shapes(y) == st.sharding_shapes(ref), \
        f"{what}: extents {st.sharding_shapes(y)} != {st.sharding_shapes(ref)}"
    assert tuple(y.shape) == tuple(ref.shape), f"{what}: shape {tuple(y.shape)}"
    assert st.local_offsets(y) == st.local_offsets(ref), f"{what}: offsets {st.local_offsets(y)}"
    assert y.dtype == ref.dtype and y.device == ref.device, f"{what}: {y.dtype} on {y.device}"
    assert torch.equal(y.to_local(), ref.to_local()), f"{what}: local values differ"


# ---- loading equals distribute_tensor ----

def case_load(fmt, path, two_d):
    m = the_mesh(two_d)
    full = full_values()
    for placements, extents in layouts(two_d):
        y = load(fmt, path, m, placements, extents)
        check_same(y, st.distribute_tensor(full, m, placements, extents), f"{fmt} {placements} {extents}")
    # The default split (no extents), the file's shape confirmed, no communication.
    y = load(fmt, path, m, layouts(two_d)[0][0], global_shape=SHAPE, check=False)
    check_same(y, st.distribute_tensor(full, m, layouts(two_d)[0][0]), f"{fmt} check=False")
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("fmt", LOADERS)
def test_load_equals_distribute_tensor(tmp_path, fmt, world):
    needs(fmt)
    path = write_file(fmt, tmp_path, full_values().numpy())
    harness.run(world, case_load, fmt, path, False)


@pytest.mark.parametrize("fmt", LOADERS)
def test_load_2d_mesh(tmp_path, fmt):
    needs(fmt)
    path = write_file(fmt, tmp_path, full_values().numpy())
    harness.run(4, case_load, fmt, path, True)


def case_npy_dtypes(directory):
    """Stored dtypes (big-endian, integer, bool, complex), a cast with dtype=, a 0-d and a 1-d array."""
    m = mesh()
    w = m.size()
    full = full_values()
    for name, tensor in [("be_f8", full.double()), ("i8", (full * 10).long()), ("bool", full > 0),
                         ("c8", torch.complex(full, -full))]:
        y = st.io.load_npy(os.path.join(directory, name + ".npy"), m, [st.Shard(1)],
                           {0: uneven_extents(SHAPE[1], w, 1)})
        check_same(y, st.distribute_tensor(tensor, m, [st.Shard(1)], {0: uneven_extents(SHAPE[1], w, 1)}), name)
    y = st.io.load_npy(os.path.join(directory, "be_f8.npy"), m, [st.Shard(0)], dtype=torch.float32)
    check_same(y, st.distribute_tensor(full.double().float(), m, [st.Shard(0)]), "dtype=float32")
    y = st.io.load_npy(os.path.join(directory, "scalar.npy"), m, [st.Replicate()])
    check_same(y, st.distribute_tensor(torch.tensor(2.5), m, [st.Replicate()]), "0-d")
    y = st.io.load_npy(os.path.join(directory, "line.npy"), m, [st.Shard(0)], {0: tiny_extents(5, w)})
    check_same(y, st.distribute_tensor(torch.arange(5), m, [st.Shard(0)], {0: tiny_extents(5, w)}), "1-d")
    return True


@pytest.mark.parametrize("world", [1, 3])
def test_npy_dtypes(tmp_path, world):
    full = full_values().numpy()
    np.save(tmp_path / "be_f8.npy", full.astype(">f8"))
    np.save(tmp_path / "i8.npy", (torch.from_numpy(full) * 10).long().numpy())
    np.save(tmp_path / "bool.npy", full > 0)
    np.save(tmp_path / "c8.npy", (full - 1j * full).astype(np.complex64))
    np.save(tmp_path / "scalar.npy", np.array(2.5, np.float32))
    np.save(tmp_path / "line.npy", np.arange(5))
    harness.run(world, case_npy_dtypes, str(tmp_path))


def hdf5_dtype_values():
    full = full_values()
    return {"be_f8": full.double(), "i2": (full * 10).short(), "bool": full > 0, "c8": torch.complex(full, -full)}


def case_hdf5_dtypes(path):
    """Contiguous datasets read byte-wise (big-endian, integer, bool, complex; a file with a user block) and a
    dataset never written (its fill value, through HDF5)."""
    m = mesh()
    extents = {0: uneven_extents(SHAPE[1], m.size(), 1)}
    for name, tensor in hdf5_dtype_values().items():
        y = st.io.load_hdf5(path, name, m, [st.Shard(1)], extents)
        check_same(y, st.distribute_tensor(tensor, m, [st.Shard(1)], extents), name)
    y = st.io.load_hdf5(path, "unwritten", m, [st.Shard(0)])
    check_same(y, st.distribute_tensor(torch.full((5, 3), 7.0), m, [st.Shard(0)]), "fill value")
    return True


def test_hdf5_dtypes(tmp_path):
    needs("hdf5")
    import h5py
    path = str(tmp_path / "dtypes.h5")
    with h5py.File(path, "w", userblock_size=512) as f:
        for name, tensor in hdf5_dtype_values().items():
            data = tensor.numpy()
            f.create_dataset(name, data=data.astype(">f8") if name == "be_f8" else data)
        f.create_dataset("unwritten", shape=(5, 3), dtype="f4", fillvalue=7.0)
        assert f["be_f8"].dtype == np.dtype(">f8")
    harness.run(3, case_hdf5_dtypes, path)


def case_open_objects(h5_path, zarr_path, nc_path):
    """Already-open sources: an h5py File and Dataset, a zarr Group and Array, an xarray Dataset and DataArray."""
    import h5py
    import xarray as xr
    import zarr
    m = mesh()
    ref = st.distribute_tensor(full_values(), m, [st.Shard(0)])
    with h5py.File(h5_path, "r") as f:
        check_same(st.io.load_hdf5(f, "fields/u", m, [st.Shard(0)]), ref, "h5py.File")
        check_same(st.io.load_hdf5(f["fields/u"], None, m, [st.Shard(0)]), ref, "h5py.Dataset")
        check_same(st.io.load_array(f["fields/u"], m, [st.Shard(0)]), ref, "load_array(h5py.Dataset)")
    group = zarr.open_group(zarr_path, mode="r")
    check_same(st.io.load_zarr(group, m, [st.Shard(0)], name="u"), ref, "zarr.Group")
    check_same(st.io.load_zarr(group["u"], m, [st.Shard(0)]), ref, "zarr.Array")
    check_same(st.io.load_zarr(os.path.join(zarr_path, "u"), m, [st.Shard(0)]), ref, "path of the array")
    with xr.open_dataset(nc_path, engine="h5netcdf") as ds:
        check_same(st.io.load_xarray(ds, "u", m, [st.Shard(0)]), ref, "xarray.Dataset")
        check_same(st.io.load_xarray(ds["u"], None, m, [st.Shard(0)]), ref, "xarray.DataArray")
    return True


def test_open_objects(tmp_path):
    for fmt in ("hdf5", "zarr", "xarray_h5netcdf"):
        needs(fmt)
    full = full_values().numpy()
    paths = [write_file(fmt, tmp_path, full) for fmt in ("hdf5", "zarr", "xarray_h5netcdf")]
    harness.run(2, case_open_objects, *paths)


# ---- each rank reads its slab only ----

def io_counters():
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


def rchar_of(fn):
    """(bytes this process read while ``fn()`` ran, ``fn()``), less the read of the counters themselves (the
    first reading counts in the second; its length varies by a few digits, hence the slack of the callers)."""
    a, b = io_counters()["rchar"], io_counters()["rchar"]
    own = b - a
    before = io_counters()["rchar"]
    out = fn()
    return io_counters()["rchar"] - before - own, out


class CountingFile(io.FileIO):
    """A binary file that counts the bytes read through it (h5py reads through Python file objects)."""

    def __init__(self, path):
        super().__init__(path, "rb")
        self.nbytes = 0

    def readinto(self, b):
        n = super().readinto(b)
        self.nbytes += n or 0
        return n

    def read(self, size=-1):
        data = super().read(size)
        self.nbytes += len(data)
        return data


def counting_store(path):
    """A zarr store over ``path`` that records the key of every read."""
    from zarr.storage import LocalStore, WrapperStore

    class Counting(WrapperStore):
        keys = []

        async def get(self, key, prototype, byte_range=None):
            Counting.keys.append(key)
            return await super().get(key, prototype, byte_range)

        async def get_partial_values(self, prototype, key_ranges):
            Counting.keys.extend(k for k, _ in key_ranges)
            return await super().get_partial_values(prototype, key_ranges)

    return Counting(LocalStore(path, read_only=True)), Counting.keys


def intersecting_chunks(start, stop, chunks):
    """Grid indices of the chunks a slab intersects."""
    import itertools
    if any(a == b for a, b in zip(start, stop)):
        return set()
    return set(itertools.product(*(range(a // c, (b - 1) // c + 1) for a, b, c in zip(start, stop, chunks))))


def slab(x):
    start = st.local_offsets(x)
    return start, tuple(a + e for a, e in zip(start, x.to_local().shape))


def case_bytes_read(fmt, path, two_d, chunks):
    m = the_mesh(two_d)
    w = m.size() if not two_d else 2
    full = full_values(BIG, seed=5)
    cases = ([([st.Shard(0), st.Shard(1)], {0: [3, 5], 1: [16, 0]}), ([st.Replicate(), st.Shard(1)], None)]
             if two_d else [([st.Shard(0)], {0: uneven_extents(BIG[0], w, 2)}),
                            ([st.Shard(1)], {0: tiny_extents(BIG[1], w)})])
    whole = full.numel() * 4
    for placements, extents in cases:
        what = f"{fmt} {placements} {extents}"
        ref = st.distribute_tensor(full, m, placements, extents)
        nbytes = ref.to_local().numel() * 4
        if fmt == "npy":
            # check=False: no collective inside the window (sockets count in rchar too).
            read, y = rchar_of(lambda: st.io.load_npy(path, m, placements, extents, check=False))
            with open(path, "rb") as f:
                header = st.io.npy.read_header(f)[3]
            assert abs(read - (header + nbytes)) <= 8, f"{what}: read {read} bytes, slab {nbytes} + header {header}"
        elif fmt in ("hdf5", "hdf5_chunked", "xarray_h5netcdf"):
            f = CountingFile(path)
            try:
                if fmt == "xarray_h5netcdf":
                    import xarray as xr
                    with xr.open_dataset(f, engine="h5netcdf", cache=False) as ds:
                        f.nbytes = 0   # what opening the dataset read (its metadata) does not count
                        y = st.io.load_xarray(ds, "u", m, placements, extents)
                else:
                    import h5py
                    with h5py.File(f, "r") as h5:
                        f.nbytes = 0
                        y = st.io.load_hdf5(h5, "fields/u", m, placements, extents)
                        ds = h5["fields/u"]
                        if ds.chunks:   # the compressed chunks the slab intersects, whole, and no others
                            hit = intersecting_chunks(*slab(ref), ds.chunks)
                            infos = [ds.id.get_chunk_info(i) for i in range(ds.id.get_num_chunks())]
                            nbytes = sum(c.size for c in infos if
                                         tuple(o // k for o, k in zip(c.chunk_offset, ds.chunks)) in hit)
                            whole = sum(c.size for c in infos)
            finally:
                f.close()
            # Metadata (object headers, the chunk index) comes on top: a few KiB.
            assert nbytes <= f.nbytes <= nbytes + 16384, f"{what}: read {f.nbytes} bytes, slab {nbytes}"
            assert nbytes == whole or f.nbytes < whole, f"{what}: read {f.nbytes} bytes, the whole data {whole}"
            if fmt == "hdf5":   # by name: the contiguous dataset's bytes are read directly (positioned reads)
                read, y = rchar_of(lambda: st.io.load_hdf5(path, "fields/u", m, placements, extents, check=False))
                assert nbytes <= read <= nbytes + 16384, f"{what} by name: read {read} bytes, slab {nbytes}"
        else:   # zarr, xarray over zarr: exactly the chunks the slab intersects
            store, keys = counting_store(path)
            keys.clear()
            if fmt == "zarr":
                y = st.io.load_zarr(store, m, placements, extents, name="u")
            else:
                y = st.io.load_xarray(store, "u", m, placements, extents, engine="zarr",
                                      open_kwargs={"consolidated": False})
            fetched = {tuple(int(i) for i in k.split("/")[2:]) for k in keys if k.startswith("u/c/")}
            expected = intersecting_chunks(*slab(ref), chunks)
            assert fetched == expected, f"{what}: fetched chunks {sorted(fetched)}, slab's {sorted(expected)}"
        check_same(y, ref, what)
    return True


BYTES_FORMATS = ["npy", "hdf5", "hdf5_chunked", "zarr", "xarray_zarr", "xarray_h5netcdf"]


@pytest.mark.parametrize("two_d", [False, True], ids=["1d", "2x2"])
@pytest.mark.parametrize("fmt", BYTES_FORMATS)
def test_reads_only_its_slab(tmp_path, fmt, two_d):
    needs(fmt)
    chunks = (1, 4, 512)
    path = write_file(fmt, tmp_path, full_values(BIG, seed=5).numpy(), chunks=chunks)
    harness.run(4 if two_d else 3, case_bytes_read, fmt, path, two_d, chunks)


def case_short_runs(path):
    """Sharding the last dim of a C-order array gives runs shorter than raw.MIN_RUN: read as whole rows (still
    the same values, and never more than the rows that hold the slab)."""
    m = mesh()
    full = full_values(BIG, seed=5)
    extents = {0: uneven_extents(BIG[2], m.size(), 4)}
    for placements in ([st.Shard(2)], [st.Shard(-1)]):
        read, y = rchar_of(lambda: st.io.load_npy(path, m, placements, extents, check=False))
        check_same(y, st.distribute_tensor(full, m, placements, extents), "short runs")
        assert read <= full.numel() * 4 + 4096, read
    return True


def test_short_runs(tmp_path):
    path = write_file("npy", tmp_path, full_values(BIG, seed=5).numpy())
    harness.run(3, case_short_runs, path)


# ---- writing ----

def save(fmt, x, path, **kwargs):
    if fmt == "npy":
        st.io.save_npy(x, path)
    elif fmt == "hdf5":
        st.io.save_hdf5(x, path, "fields/u", **kwargs)
    else:
        st.io.save_zarr(x, path, "u", **kwargs)


def read_back(fmt, path):
    """The whole file, read with the format's own library."""
    if fmt == "npy":
        return np.load(path)
    if fmt == "hdf5":
        import h5py
        with h5py.File(path, "r") as f:
            return f["fields/u"][...]
    import zarr
    return zarr.open_array(path, path="u", mode="r")[...]


def case_roundtrip(fmt, directory, two_d, zarr_chunks):
    """Write each layout, then read it back in the next layout; returns the bytes each rank wrote per file."""
    from shardtensor.io import raw
    m = the_mesh(two_d)
    full = full_values()
    cases = layouts(two_d)
    written, expected = [], []
    original = raw.write_slab

    def counting_write_slab(fd, base, shape, data, start):
        written[-1] += data.nbytes
        return original(fd, base, shape, data, start)

    raw.write_slab = counting_write_slab
    try:
        for i, (placements, extents) in enumerate(cases):
            path = os.path.join(directory, f"{fmt}_{i}")
            x = st.distribute_tensor(full, m, placements, extents)
            written.append(0)
            kwargs = {"chunks": zarr_chunks} if fmt == "zarr" and zarr_chunks else {}
            save(fmt, x, path, **kwargs)
            back, back_extents = cases[(i + 1) % len(cases)]
            y = load(fmt, path, m, back, back_extents)
            check_same(y, st.distribute_tensor(full, m, back, back_extents), f"{fmt} {placements} -> {back}")
            writer = all(c == 0 for c, p in zip(m.get_coordinate(), x.placements) if p.is_replicate())
            expected.append(x.to_local().numel() * 4 if writer else 0)
    finally:
        raw.write_slab = original
    # Asserted after the loop, so a wrong count on one rank cannot leave the others in the next layout's collectives.
    if fmt != "zarr":   # zarr writes through its own store
        assert written == expected, f"{fmt}: bytes written per layout {written}, expected {expected}"
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("fmt", WRITERS)
def test_roundtrip(tmp_path, fmt, world):
    needs(fmt)
    harness.run(world, case_roundtrip, fmt, str(tmp_path), False, None)
    for i in range(N_LAYOUTS[False]):
        np.testing.assert_array_equal(read_back(fmt, os.path.join(str(tmp_path), f"{fmt}_{i}")),
                                      full_values().numpy(), err_msg=f"{fmt} file {i}")


@pytest.mark.parametrize("fmt", WRITERS)
def test_roundtrip_2d_mesh(tmp_path, fmt):
    needs(fmt)
    harness.run(4, case_roundtrip, fmt, str(tmp_path), True, None)
    for i in range(N_LAYOUTS[True]):
        np.testing.assert_array_equal(read_back(fmt, os.path.join(str(tmp_path), f"{fmt}_{i}")),
                                      full_values().numpy(), err_msg=f"{fmt} file {i}")


@pytest.mark.parametrize("world,two_d", [(3, False), (4, False), (4, True)])
def test_zarr_chunks_shared_by_ranks(tmp_path, world, two_d):
    """Chunks that straddle shard boundaries (rims written in turns) still give the exact array."""
    needs("zarr")
    import zarr
    harness.run(world, case_roundtrip, "zarr", str(tmp_path), two_d, (4, 3, 3))
    for i in range(N_LAYOUTS[two_d]):
        path = os.path.join(str(tmp_path), f"zarr_{i}")
        np.testing.assert_array_equal(read_back("zarr", path), full_values().numpy(), err_msg=f"zarr file {i}")
        assert zarr.open_array(path, path="u", mode="r").chunks == (4, 3, 3)


def test_zarr_default_chunks_align_with_shards():
    from shardtensor.io.layout import Layout
    from shardtensor.io.zarr_array import default_chunks, split_by_chunks

    def layout(shape, extents, mesh_shape=(4,)):
        return Layout(shape, mesh_shape, (0,), (st.Shard(0),), {0: extents}, (0,) * len(shape), shape)

    assert default_chunks(layout((4096, 64), [1024] * 4), 4) == (1024, 64)
    assert default_chunks(layout((10, 3), [1, 0, 5, 4]), 4) == (1, 3)   # gcd(1, 1, 6) = 1 >= 5 / 16
    assert default_chunks(layout((4097, 8), [1025, 1024, 1024, 1024]), 4) == (65, 8)   # no alignment: 1/16
    big = default_chunks(layout((64, 4096, 4096), [16] * 4), 4)
    assert big[0] == 16 and 16 * big[1] * big[2] * 4 <= 32 << 20, big
    inner, rims = split_by_chunks((3, 0), (9, 4), (10, 4), (4, 2))
    assert inner == ((4, 0), (8, 4)) and sorted(rims) == [((3, 0), (4, 4)), ((8, 0), (9, 4))]
    assert split_by_chunks((1, 0), (3, 4), (10, 4), (4, 2)) == (None, [((1, 0), (3, 4))])
    assert split_by_chunks((8, 0), (10, 4), (10, 4), (4, 2)) == (((8, 0), (10, 4)), [])   # the partial last chunk


# ---- errors, on every rank ----

def case_error(fmt, path, kind):
    m = mesh()
    if kind == "partial":
        load(fmt, path, m, [st.Partial()])
    elif kind == "global_shape":
        load(fmt, path, m, [st.Shard(0)], global_shape=(9, 7, 5))
    elif kind == "extents":
        load(fmt, path, m, [st.Shard(0)], {0: [1] * m.size()})
    elif kind == "missing":
        key = {"hdf5": "dataset", "zarr": "name", "xarray_zarr": "variable"}[fmt]
        load(fmt, path, m, [st.Shard(0)], **{key: "nope"})
    elif kind == "one_rank_missing_file":
        load(fmt, path + ("_not_there" if m.get_coordinate()[0] == 1 else ""), m, [st.Shard(0)])
    elif kind == "save_partial":
        save(fmt, st.distribute_tensor(full_values(), m, [st.Shard(0)]).sum(0), path + "_partial")
    elif kind == "save_no_directory":
        save(fmt, st.distribute_tensor(full_values(), m, [st.Shard(0)]), os.path.join(path, "x"))   # path: a file


ERRORS = [("partial", "Partial"), ("global_shape", "global_shape"), ("extents", "sharding_shapes")]


@pytest.mark.parametrize("kind,match", ERRORS)
@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr", "xarray_zarr"])
def test_load_errors_on_every_rank(tmp_path, fmt, kind, match):
    needs(fmt)
    path = write_file(fmt, tmp_path, full_values().numpy())
    harness.expect_error(2, case_error, fmt, path, kind, match=match)


@pytest.mark.parametrize("fmt,match", [("hdf5", "no dataset 'nope'"), ("zarr", "no array 'nope'"),
                                       ("xarray_zarr", "no variable 'nope'")])
def test_missing_dataset_on_every_rank(tmp_path, fmt, match):
    needs(fmt)
    path = write_file(fmt, tmp_path, full_values().numpy())
    harness.expect_error(3, case_error, fmt, path, "missing", match=match)


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_one_rank_cannot_read(tmp_path, fmt):
    """A failure on one rank only (its path does not exist) raises on every rank, naming that rank."""
    needs(fmt)
    path = write_file(fmt, tmp_path, full_values().numpy())
    errors = harness.expect_error(3, case_error, fmt, path, "one_rank_missing_file", match="",
                                  kinds=("FileNotFoundError", "RuntimeError", "OSError"))
    assert errors[1][0] in ("FileNotFoundError", "OSError"), errors[1]
    assert all("rank(s) [1]" in errors[r][1] for r in (0, 2)), errors


@pytest.mark.parametrize("fmt", WRITERS)
def test_save_errors_on_every_rank(tmp_path, fmt):
    needs(fmt)
    harness.expect_error(2, case_error, fmt, str(tmp_path / "out"), "save_partial", match="Partial")
    # The first rank cannot create the file (its directory is a file): every rank raises (the others naming it)
    # instead of waiting.
    (tmp_path / "a_file").write_text("")
    errors = harness.expect_error(2, case_error, fmt, str(tmp_path / "a_file"), "save_no_directory", match="",
                                  kinds=("FileNotFoundError", "NotADirectoryError", "FileExistsError", "OSError",
                                         "RuntimeError"))
    assert "rank(s) [0]" in errors[1][1], errors


def case_two_mesh_dims_one_tensor_dim(path):
    st.io.load_npy(path, mesh((2, 2), ("a", "b")), [st.Shard(0), st.Shard(0)])


def test_one_tensor_dim_on_two_mesh_dims(tmp_path):
    path = write_file("npy", tmp_path, full_values().numpy())
    harness.expect_error(4, case_two_mesh_dims_one_tensor_dim, path, match="several mesh dims")


def case_hdf5_existing_dataset(path):
    st.io.save_hdf5(st.distribute_tensor(full_values(), mesh(), [st.Shard(0)]), path, "fields/u", mode="a")


def test_hdf5_append_refuses_existing_dataset(tmp_path):
    needs("hdf5")
    path = write_file("hdf5", tmp_path, full_values().numpy())
    harness.expect_error(2, case_hdf5_existing_dataset, path, match="already holds")


@pytest.mark.parametrize("module,call", [
    ("h5py", lambda: st.io.load_hdf5("x.h5", "u", None, [st.Shard(0)])),
    ("h5py", lambda: st.io.save_hdf5(None, "x.h5", "u")),
    ("zarr", lambda: st.io.load_zarr("x.zarr", None, [st.Shard(0)])),
    ("zarr", lambda: st.io.save_zarr(None, "x.zarr")),
    ("xarray", lambda: st.io.load_xarray("x.nc", "u", None, [st.Shard(0)])),
])
def test_missing_library_names_the_package(monkeypatch, module, call):
    monkeypatch.setitem(__import__("sys").modules, module, None)
    with pytest.raises(ImportError, match=f"pip install {module}"):
        call()


# ---- outputs published only when complete; inputs agreed on (issue 30 item 3) ----

KILL_SCRIPT = r"""
import os, sys, datetime, json
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
import shardtensor as st
from shardtensor.io import raw

rank, world, port, fmt, path, how, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], \
    sys.argv[6], sys.argv[7]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=20))
mesh = init_device_mesh("cpu", (world,))
x = st.distribute_tensor(torch.arange(9 * 7 * 4, dtype=torch.float32).view(9, 7, 4) + 1000, mesh, [st.Shard(0)])
original = raw.write_slab
zarr_set = None

def dying_write(*args, **kwargs):
    if rank == 1:
        original(*args, **kwargs)          # part of the slab lands in the file first
        if how == "die":
            os._exit(17)                   # killed mid-save
        raise OSError("disk full (simulated)")
    return original(*args, **kwargs)

raw.write_slab = dying_write
if fmt == "zarr":
    import zarr
    real_setitem = zarr.Array.__setitem__
    def dying_setitem(self, key, value):
        real_setitem(self, key, value)
        if rank == 1:
            if how == "die":
                os._exit(17)
            raise OSError("disk full (simulated)")
    zarr.Array.__setitem__ = dying_setitem
try:
    if fmt == "npy":
        st.io.save_npy(x, path)
    elif fmt == "hdf5":
        st.io.save_hdf5(x, path, "u")
    else:
        st.io.save_zarr(x, path, "u")
    result = ["ok", ""]
except Exception as e:
    result = [type(e).__name__, str(e)]
with open(out + f".{rank}", "w") as f:
    json.dump(result, f)
# Rank 0 hosts the job's store, which the survivors ask who stopped: stay until every survivor has its answer.
import time
deadline = time.time() + 60
while time.time() < deadline and not all(os.path.exists(out + f".{r}") for r in range(world) if r != 1 or how != "die"):
    time.sleep(0.05)
os._exit(0)
"""


def _read_saved(fmt, path):
    if fmt == "npy":
        return np.load(path)
    if fmt == "hdf5":
        import h5py
        with h5py.File(path, "r") as f:
            return f["u"][...]
    import zarr
    return zarr.open_array(path, path="u", mode="r")[...]


@pytest.mark.parametrize("fmt,how", [("npy", "die"), ("hdf5", "die"), ("zarr", "die"), ("npy", "raise")])
def test_failed_save_publishes_nothing(tmp_path, fmt, how):
    """A rank killed (or raising) inside its slab write: nothing under the name loads afterwards (an earlier file
    there is untouched), and the survivors' error names the save and the rank (not the transport's text)."""
    import subprocess
    import sys
    needs(fmt)
    world = 3
    path = str(tmp_path / {"npy": "out.npy", "hdf5": "out.h5", "zarr": "out.zarr"}[fmt])
    earlier = full_values().numpy()
    if fmt == "npy":
        np.save(path, earlier)
    elif fmt == "hdf5":
        import h5py
        with h5py.File(path, "w") as f:
            f.create_dataset("u", data=earlier)
    else:
        import zarr
        zarr.create_array(store=path, name="u", shape=earlier.shape, dtype=earlier.dtype)[...] = earlier
    out = str(tmp_path / "result")
    port = str(harness._free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(st.__file__)), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(r), str(world), port, fmt, path, how, out],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(world)]
    for p in procs:
        p.wait(timeout=120)
    import json
    for r in range(world):
        if how == "die" and r == 1:
            assert procs[r].returncode == 17
            continue
        with open(f"{out}.{r}") as f:
            kind, msg = json.load(f)
        assert kind != "ok", f"rank {r} finished the save"
        if how == "raise" and r == 1:
            assert "disk full" in msg, msg           # the failing rank raises its own error
            continue
        what = {"npy": "save_npy", "hdf5": "save_hdf5", "zarr": "save_zarr"}[fmt]
        assert what in msg and path in msg, msg
        if how == "die":
            assert "rank(s) [1]" in msg and "stopped before finishing" in msg, msg
        elif r != 1:
            assert "rank(s) [1]" in msg and "disk full" in msg, msg
    np.testing.assert_array_equal(_read_saved(fmt, path), earlier)   # the earlier file, whole
    assert not any("shardtensor-partial" in n for n in os.listdir(tmp_path) if how == "raise"), os.listdir(tmp_path)


def case_file_versions_differ(paths):
    """Each rank opens "the file" and gets another version of the same shape (what a replacement between the
    ranks' opens gives): every rank raises instead of returning slabs of two versions."""
    import torch.distributed as dist
    st.io.load_npy(paths[dist.get_rank() % len(paths)], mesh(), [st.Shard(0)])


def test_npy_versions_differ_between_ranks(tmp_path):
    a, b = str(tmp_path / "a.npy"), str(tmp_path / "b.npy")
    np.save(a, full_values().numpy())
    np.save(b, full_values(seed=5).numpy())
    for world in (2, 3):
        errors = harness.expect_error(world, case_file_versions_differ, [a, b], match="different versions",
                                      kinds=("ValueError",))
        assert len({msg for _, msg, _ in errors.values()}) == 1
    harness.run(2, case_load, "npy", a, False)   # the same file everywhere still loads


def case_mesh_not_referenced(fmt, path):
    """The DeviceMesh a tensor was made with, dropped by the user: the writers still find its process groups."""
    import gc
    from torch.distributed.device_mesh import DeviceMesh
    import torch.distributed as dist
    x = st.distribute_tensor(full_values(), DeviceMesh("cpu", list(range(dist.get_world_size()))), [st.Shard(0)])
    gc.collect()
    save(fmt, x, path)
    assert st.device_mesh(x).mesh.tolist() == list(range(dist.get_world_size()))
    return True


@pytest.mark.parametrize("fmt", WRITERS)
def test_writers_without_the_users_mesh(tmp_path, fmt):
    needs(fmt)
    path = str(tmp_path / f"m_{fmt}")
    harness.run(2, case_mesh_not_referenced, fmt, path)
    np.testing.assert_array_equal(read_back(fmt, path), full_values().numpy())
