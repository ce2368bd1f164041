"""Synthetic inputs for the three paper workloads: no downloads, deterministic for a given seed, any size.

- ``random_images``: seeded random images and class labels (the ViT benchmark uses random data too).
- ``ellipsoid_surface``: a DrivAerML-shaped surface sample: N points on an ellipsoid with the car's
  proportions, exact unit normals and area weights, and the surface pressure and a wall-shear stand-in from
  the analytic potential flow around the ellipsoid (scales to millions of points).
- ``storm_fields`` / ``stormscope_batch``: smooth multi-scale fields (sums of seeded random Fourier modes at
  several wavelengths) with the StormScope GOES channel layout on an H x W grid (1024 x 1792 at full size).

All generators draw in float64 from their own ``torch.Generator`` and return float32 (or ``dtype``) tensors,
so the same seed gives bit-identical data on every rank and every run.
"""
from __future__ import annotations

import math
from typing import Dict, Sequence, Tuple

import numpy as np
import torch

from .stormscope import CONDITION_CHANNELS, GOES_BANDS


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


# ---------------------------------------------------------------------------------------------------- images

def random_images(batch: int, channels: int, size: Sequence[int], num_classes: int = 1000, seed: int = 0,
                  dtype=torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(x, labels)``: ``x`` of shape ``(batch, channels, *size)`` (2-D or 3-D images) with standard normal
    values, ``labels`` of shape ``(batch,)`` in ``[0, num_classes)``."""
    g = _gen(seed)
    x = torch.randn((batch, channels, *size), generator=g, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, num_classes, (batch,), generator=g)
    return x, labels


# ------------------------------------------------------------------------------------------ ellipsoid flow

# DrivAerML-like proportions (length, width, height of a car, in metres) and the datapipe's position scaling.
CAR_SEMI_AXES = (2.35, 1.0, 0.72)
REFERENCE_SCALE = (12.0, 4.5, 3.25)
RHO_REF, U_REF = 1.205, 38.89       # reference density and stream velocity used to normalise the targets
SKIN_FRICTION = 4e-3                # the wall-shear stand-in: tau = cf * q * (tangential velocity / U)


def ellipsoid_depolarisation(a: float, b: float, c: float, nodes: int = 256) -> float:
    """``alpha_0 = a b c * int_0^inf dl / ((a^2 + l) sqrt((a^2 + l)(b^2 + l)(c^2 + l)))`` (Lamb, Hydrodynamics
    §114), by Gauss-Legendre quadrature after ``l = s / (1 - s)``; ``2/3`` for a sphere."""
    s, w = np.polynomial.legendre.leggauss(nodes)
    s = 0.5 * (s + 1.0)
    w = 0.5 * w
    lam = s / (1.0 - s)
    jac = 1.0 / (1.0 - s) ** 2
    f = 1.0 / ((a * a + lam) * np.sqrt((a * a + lam) * (b * b + lam) * (c * c + lam)))
    return float(a * b * c * np.sum(w * f * jac))


def ellipsoid_surface(n_points: int, seed: int = 0, batch: int = 1, semi_axes=CAR_SEMI_AXES,
                      dtype=torch.float32) -> Dict[str, torch.Tensor]:
    """A DrivAerML-shaped surface sample (the Transolver inputs and targets), per the paper report §3.7.

    The stream (velocity ``U`` along +x, density ``rho``, both drawn per sample) flows around an ellipsoid
    with semi-axes ``semi_axes``. In potential flow the velocity on the surface is the tangential part of the
    uniform vector ``U e_x * 2 / (2 - alpha_0)`` (Lamb §114), so ``Cp = 1 - (2/(2 - alpha_0))^2 (1 - n_x^2)``
    (the sphere's ``1 - 9/4 sin^2 theta``). Wall shear is a stand-in: ``cf * q * u_t / U``.

    Points are uniform on the unit sphere (seeded, random order: any contiguous split of the points covers the
    whole surface), mapped to the ellipsoid; area weights are exact for that map.

    Returns (``B = batch``, ``N = n_points``):
      ``embedding (B, N, 6)``: positions centred and divided by ``REFERENCE_SCALE``, unit normals;
      ``fx (B, N, 2)``: ``rho / RHO_REF`` and ``U / U_REF`` broadcast over the points;
      ``target (B, N, 4)``: pressure and wall shear (x, y, z) divided by the reference dynamic pressure;
      ``areas (B, N)``: surface area per point (m^2; they sum to the ellipsoid's area);
      ``cp (B, N)``: the pressure coefficient.
    """
    a, b, c = semi_axes
    g = _gen(seed)
    axes = torch.tensor([a, b, c], dtype=torch.float64)
    cmul = 2.0 / (2.0 - ellipsoid_depolarisation(a, b, c))
    out = {k: [] for k in ("embedding", "fx", "target", "areas", "cp")}
    q_ref = 0.5 * RHO_REF * U_REF ** 2
    for _ in range(batch):
        u = torch.randn(n_points, 3, generator=g, dtype=torch.float64)
        u = u / u.norm(dim=1, keepdim=True).clamp_min(1e-300)              # uniform on the unit sphere
        pos = u * axes                                                      # on the ellipsoid
        grad = u / axes                                                     # normal direction: grad of sum (x_i/a_i)^2
        gnorm = grad.norm(dim=1, keepdim=True)
        normal = grad / gnorm
        # dA_ellipsoid = a b c |u / axes| dA_sphere, and each sphere sample carries 4 pi / N of area.
        areas = (4.0 * math.pi / n_points) * (a * b * c) * gnorm.squeeze(1)
        rho = 1.1 + 0.2 * torch.rand((), generator=g, dtype=torch.float64)
        speed = U_REF * (0.8 + 0.4 * torch.rand((), generator=g, dtype=torch.float64))
        nx = normal[:, 0:1]
        ex = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
        u_t = cmul * (ex - nx * normal)                                     # surface velocity / U
        cp = 1.0 - (u_t * u_t).sum(dim=1)
        q = 0.5 * rho * speed ** 2
        tau = SKIN_FRICTION * q * u_t
        out["embedding"].append(torch.cat([pos / torch.tensor(REFERENCE_SCALE, dtype=torch.float64), normal], dim=1))
        out["fx"].append(torch.stack([rho / RHO_REF, speed / U_REF]).expand(n_points, 2))
        out["target"].append(torch.cat([(q * cp).unsqueeze(1), tau], dim=1) / q_ref)
        out["areas"].append(areas)
        out["cp"].append(cp)
    return {k: torch.stack(v).to(dtype) for k, v in out.items()}


# ------------------------------------------------------------------------------------------- storm fields

def multiscale_field(channels: int, height: int, width: int, seed: int, batch: int = 1, modes_per_scale: int = 8,
                     wavelengths=(0.6, 0.15, 0.04), slope: float = 1.0, time: float = 0.0,
                     dtype=torch.float32) -> torch.Tensor:
    """``(batch, channels, height, width)``: per channel, a sum of ``modes_per_scale`` plane waves at each
    relative wavelength in ``wavelengths`` (fractions of the grid's larger side), random directions and phases,
    amplitude ``wavelength ** slope`` (large scales dominate), normalised to unit variance. ``time`` advects each
    mode along its direction (phase speed proportional to the wavelength), for a state and its successor.

    Each mode ``cos(kx x + ky y + phi)`` is ``cos(kx x + phi) cos(ky y) - sin(kx x + phi) sin(ky y)``, so the
    field is two matrix products ``(H, M) @ (M, W)``: cheap at 1024 x 1792."""
    g = _gen(seed)
    side = float(max(height, width))
    lam = torch.tensor(wavelengths, dtype=torch.float64).repeat_interleave(modes_per_scale) * side  # (M,)
    m = lam.numel()
    theta = 2 * math.pi * torch.rand(batch, channels, m, generator=g, dtype=torch.float64)
    kmag = (2 * math.pi / lam) * (1.0 + 0.3 * torch.rand(batch, channels, m, generator=g, dtype=torch.float64))
    phase = 2 * math.pi * torch.rand(batch, channels, m, generator=g, dtype=torch.float64)
    amp = (lam / side) ** slope * (0.5 + torch.rand(batch, channels, m, generator=g, dtype=torch.float64))
    kx, ky = kmag * torch.cos(theta), kmag * torch.sin(theta)
    phase = phase - time * kmag * lam / side * 4.0                 # advection: a few grid cells per unit time
    xs = torch.arange(height, dtype=torch.float64)
    ys = torch.arange(width, dtype=torch.float64)
    ax = xs[None, None, :, None] * kx[:, :, None, :] + phase[:, :, None, :]   # (B, C, H, M)
    ay = ys[None, None, :, None] * ky[:, :, None, :]                          # (B, C, W, M)
    field = (amp[:, :, None, :] * torch.cos(ax)) @ torch.cos(ay).transpose(-1, -2) \
        - (amp[:, :, None, :] * torch.sin(ax)) @ torch.sin(ay).transpose(-1, -2)
    field = field / (0.5 * (amp * amp).sum(-1)).sqrt()[:, :, None, None]       # each mode has variance a^2 / 2
    return field.to(dtype)


def storm_fields(height: int, width: int, seed: int = 0, batch: int = 1, dtype=torch.float32) -> Dict[str, torch.Tensor]:
    """One StormScope GOES sample on an ``height x width`` grid (the model's channel layout):

    ``state (B, 8, H, W)``: the 8 ABI bands at the input time; ``target (B, 8, H, W)``: the same bands one step
    later (the modes advected); ``condition (B, 14, H, W)``: ``CONDITION_CHANNELS`` = the input state, normalised
    latitude and longitude, cos-zenith at input and target times, topography and radar proximity."""
    base = 7919 * int(seed)
    state = multiscale_field(len(GOES_BANDS), height, width, base + 1, batch, time=0.0, dtype=torch.float64)
    target = multiscale_field(len(GOES_BANDS), height, width, base + 1, batch, time=1.0, dtype=torch.float64)
    gy = torch.linspace(-1.0, 1.0, height, dtype=torch.float64)[:, None].expand(height, width)
    gx = torch.linspace(-1.0, 1.0, width, dtype=torch.float64)[None, :].expand(height, width)
    lat = -gy + 0.05 * gx * gx                                   # a Lambert-like curvature of the latitude lines
    lon = gx * (1.0 - 0.1 * gy)
    g = _gen(base + 2)
    hour = 24.0 * torch.rand(batch, generator=g, dtype=torch.float64)

    def cos_zenith(h):
        # The sun's longitude moves 15 degrees an hour; a smooth bump over the grid, clipped at night.
        sun = (h[:, None, None] / 24.0) * 2 * math.pi
        return torch.clamp(torch.cos(sun + 0.6 * lon) * torch.cos(0.4 * (lat - 0.2)), min=0.0)

    statics = multiscale_field(2, height, width, base + 3, 1, wavelengths=(0.3, 0.08, 0.02), dtype=torch.float64)
    topo = statics[:, 0:1].expand(batch, 1, height, width)
    nexrad = torch.sigmoid(2.0 * statics[:, 1:2]).expand(batch, 1, height, width)
    condition = torch.cat([
        state,
        lat.expand(batch, 1, height, width), lon.expand(batch, 1, height, width),
        cos_zenith(hour)[:, None], cos_zenith(hour + 1.0 / 6.0)[:, None],  # the 3 km model steps 10 minutes
        topo, nexrad,
    ], dim=1)
    assert condition.shape[1] == len(CONDITION_CHANNELS)
    return {"state": state.to(dtype), "target": target.to(dtype), "condition": condition.to(dtype)}


def stormscope_batch(height: int, width: int, seed: int = 0, batch: int = 1, sigma_data: float = 0.5,
                     dtype=torch.float32) -> Dict[str, torch.Tensor]:
    """A denoising training example for the StormScope DiT: ``x (B, 22, H, W)`` = [target + sigma * noise |
    condition], ``sigma (B,)`` drawn from EDM's lognormal (P_mean -1.2, P_std 1.2), and the clean ``target``."""
    f = storm_fields(height, width, seed, batch, dtype=torch.float64)
    g = _gen(7919 * int(seed) + 4)
    sigma = torch.exp(-1.2 + 1.2 * torch.randn(batch, generator=g, dtype=torch.float64))
    noise = torch.randn(f["target"].shape, generator=g, dtype=torch.float64)
    noisy = (f["target"] * sigma_data + sigma[:, None, None, None] * noise)
    x = torch.cat([noisy, f["condition"]], dim=1)
    return {"x": x.to(dtype), "sigma": sigma.to(dtype), "target": (f["target"] * sigma_data).to(dtype)}
