"""The model zoo's thirteenth set: torchaudio on a long signal split along time (the nineteenth session's probe) -- one
recording too long for a device (hours of audio, a seismic trace, a long sensor record): the feature transforms a
speech or music pipeline applies to the waveform (spectrograms, mel and cepstral features, resampling, deltas,
emphasis, fades, mu-law, Griffin-Lim, time stretching, masks, convolution, noise at a set SNR, multichannel
beamforming statistics), its IIR filters (biquads, filtfilt, de-emphasis, loudness, learnable coefficients: routed
by ``shardtensor.integrations`` to a scan over the ranks) and torchaudio's networks (Conv-TasNet, Wav2Letter, wav2vec 2.0 / HuBERT / WavLM encoders,
Conformer, Hybrid Demucs), built small with random init. Transforms are wrapped as one call each
(``zoo_models_ninth.register_call``: the judge counts every torch function's output inside). Registered like
zoo_models.py's (zoo_models.py imports this module at its end)."""
import torch

from benchmarks.zoo.zoo_models import model
from benchmarks.zoo.zoo_models_ninth import register_call

_WAVE = (2, 1, 1200)          # (B, C, T): T split
_STEREO = (2, 2, 1200)
_SR = 8000


def _T():
    import torchaudio.transforms as T
    return T


def _F():
    import torchaudio.functional as F
    return F


def _tx(name, build, shape=_WAVE, **kw):
    """Register ``build()`` (a function of the waveform, torchaudio imported inside) as ``torchaudio/<name>``."""
    register_call("torchaudio", f"torchaudio/{name}", shape, build, **kw)


def _spec(**kw):
    return _T().Spectrogram(n_fft=64, hop_length=16, **kw)


def _mel_kw():
    return {"n_fft": 64, "hop_length": 16, "n_mels": 12}


# ---- spectral features (frames keep the time split: the frames dim is the last)
_tx("Spectrogram_power", lambda: _spec(power=2.0), note="centered (reflect), Hann window")
_tx("Spectrogram_complex", lambda: (lambda s: lambda x: torch.view_as_real(s(x)))(_spec(power=None)))
_tx("MelSpectrogram", lambda: _T().MelSpectrogram(sample_rate=_SR, **_mel_kw()))
_tx("MFCC_top_db", lambda: _T().MFCC(sample_rate=_SR, n_mfcc=8, melkwargs=_mel_kw()),
    note="AmplitudeToDB's top_db clamp: the max over the whole spectrogram")
_tx("LFCC", lambda: _T().LFCC(sample_rate=_SR, n_filter=12, n_lfcc=8, speckwargs={"n_fft": 64, "hop_length": 16}))
_tx("AmplitudeToDB_top_db", lambda: (lambda s, db: lambda x: db(s(x)))(_spec(power=2.0),
                                                                     _T().AmplitudeToDB("power", top_db=40.0)))
_tx("SpectralCentroid", lambda: _T().SpectralCentroid(sample_rate=_SR, n_fft=64, hop_length=16))
_tx("ComputeDeltas", lambda: (lambda s, d: lambda x: d(s(x)))(
    _T().MelSpectrogram(sample_rate=_SR, **_mel_kw()), _T().ComputeDeltas(win_length=5)),
    dtype="float32", note="replicate padding along the frames, a conv1d (its kernel is float32)")
_tx("Spectrogram_istft_roundtrip", lambda: (lambda s, i: lambda x: i(s(x), length=x.shape[-1]))(
    _spec(power=None), _T().InverseSpectrogram(n_fft=64, hop_length=16)), note="overlap-add back along time")
_tx("GriffinLim", lambda: (lambda s, g: lambda x: g(s(x)))(
    _spec(power=2.0), _T().GriffinLim(n_fft=64, hop_length=16, n_iter=3, rand_init=False, momentum=0.9)),
    note="stft / istft alternated, a momentum over the split frames")
_tx("TimeStretch", lambda: (lambda s, t: lambda x: torch.view_as_real(t(s(x))))(
    _spec(power=None), _T().TimeStretch(hop_length=16, n_freq=33, fixed_rate=1.3)), spatial_out=False,
    note="the phase vocoder: frames read at a fractional rate, a cumulative phase along time")

# ---- waveform transforms
_tx("Resample_down", lambda: _T().Resample(_SR, 6000), note="a polyphase conv1d with stride, phases interleaved")
_tx("Resample_up", lambda: _T().Resample(6000, _SR))
_tx("Preemphasis", lambda: _T().Preemphasis(0.97), note="x[t] - c x[t-1], written in place into a clone")
_tx("Fade_linear_log", lambda: (lambda a, b: lambda x: b(a(x)))(_T().Fade(200, 300, "linear"),
                                                               _T().Fade(100, 50, "logarithmic")),
    note="ramps over the first and last samples of the whole signal")
_tx("Vol_db", lambda: _T().Vol(3.0, "db"))
_tx("MuLaw_roundtrip", lambda: (lambda e, d: lambda x: d(e(torch.tanh(x))).to(x.dtype) * x)(
    _T().MuLawEncoding(64), _T().MuLawDecoding(64)))
_tx("Speed", lambda: (lambda s: lambda x: s(x)[0])(_T().Speed(_SR, 1.25)), spatial_out=False, dtype="float32",
    note="resampling by a ratio (its kernel is float32)")
_tx("FrequencyMasking", lambda: (lambda s, m: lambda x: m(s(x)))(_spec(power=2.0), _T().FrequencyMasking(6)),
    reseed=True)
_tx("TimeMasking", lambda: (lambda s, m: lambda x: m(s(x)))(_spec(power=2.0), _T().TimeMasking(10)), reseed=True,
    note="a random block of frames anywhere along the split")
_tx("FFTConvolve_full", lambda: (lambda c: lambda x: c(x, torch.linspace(-1, 1, 31, dtype=x.dtype).sin()
                                                      .expand(x.shape[0], x.shape[1], 31)))(_T().FFTConvolve("full")),
    spatial_out=False, note="an rfft of the padded signal along its split dim")
_tx("Convolve_same", lambda: (lambda c: lambda x: c(x, torch.linspace(-1, 1, 31, dtype=x.dtype).cos()
                                                   .expand(x.shape[0], x.shape[1], 31)))(_T().Convolve("same")))
_tx("AddNoise_snr", lambda: (lambda a: lambda x: a(x, x.roll(37, -1).sin(),
                                                   torch.tensor([[10.0], [3.0]], dtype=x.dtype)))(_T().AddNoise()),
    note="signal and noise energies: sums over the split time")
_tx("PSD_SoudenMVDR", lambda: (lambda s, p, m: lambda x: torch.view_as_real(m(s(x), p(s(x)), p(s(x.roll(5, -1))), 0)))(
    _spec(power=None), _T().PSD(), _T().SoudenMVDR()), shape=_STEREO, spatial_out=True,
    note="covariances summed over the split frames, then per-frequency solves")


# ---- networks
@model("torchaudio", "torchaudio/ConvTasNet", _WAVE, note="encoder conv1d with stride, global layer norm, "
       "dilated depthwise convs, transposed-conv decoder; pads the signal to a stride multiple")
def _():
    import torchaudio.models as M
    return M.ConvTasNet(num_sources=2, enc_kernel_size=16, enc_num_feats=16, msk_kernel_size=3, msk_num_feats=8,
                        msk_num_hidden_feats=16, msk_num_layers=3, msk_num_stacks=2)


@model("torchaudio", "torchaudio/Wav2Letter", (2, 1, 2560), note="conv1d stride 160 over the waveform")
def _():
    import torchaudio.models as M
    return M.Wav2Letter(num_classes=10, input_type="waveform", num_features=1)


class _Emissions(torch.nn.Module):
    """The encoder's first output (torchaudio's wav2vec 2.0 family returns (emissions, lengths)) for a (B, T)
    waveform given as (B, 1, T)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x[:, 0])[0].transpose(1, 2)


def _w2v(**kw):
    import torchaudio.models as M
    cfg = dict(extractor_mode="group_norm", extractor_conv_layer_config=[(16, 10, 5), (16, 3, 2), (16, 2, 2)],
               extractor_conv_bias=False, encoder_embed_dim=32, encoder_projection_dropout=0.0,
               encoder_pos_conv_kernel=16, encoder_pos_conv_groups=4, encoder_num_layers=2, encoder_num_heads=2,
               encoder_attention_dropout=0.0, encoder_ff_interm_features=48, encoder_ff_interm_dropout=0.0,
               encoder_dropout=0.0, encoder_layer_norm_first=False, encoder_layer_drop=0.0, aux_num_out=10)
    cfg.update(kw)
    return M.wav2vec2_model(**cfg)


@model("torchaudio", "torchaudio/Wav2Vec2", (2, 1, 1600), note="conv feature extractor (GroupNorm per channel "
       "over time), weight-normed grouped positional conv (k16, drops its last frame), attention over the split frames")
def _():
    return _Emissions(_w2v())


@model("torchaudio", "torchaudio/HuBERT_layer_norm", (2, 1, 1600), note="extractor with LayerNorm per frame, "
       "pre-norm encoder")
def _():
    return _Emissions(_w2v(extractor_mode="layer_norm", encoder_layer_norm_first=True))


@model("torchaudio", "torchaudio/WavLM", (2, 1, 1600), note="gated relative position bias over the frames")
def _():
    import torchaudio.models as M
    return _Emissions(M.wavlm_model(
        extractor_mode="group_norm", extractor_conv_layer_config=[(16, 10, 5), (16, 3, 2), (16, 2, 2)],
        extractor_conv_bias=False, encoder_embed_dim=32, encoder_projection_dropout=0.0, encoder_pos_conv_kernel=16,
        encoder_pos_conv_groups=4, encoder_num_layers=2, encoder_num_heads=2, encoder_num_buckets=16,
        encoder_max_distance=32, encoder_attention_dropout=0.0, encoder_ff_interm_features=48,
        encoder_ff_interm_dropout=0.0, encoder_dropout=0.0, encoder_layer_norm_first=False, encoder_layer_drop=0.0,
        aux_num_out=10))


class _Conformer(torch.nn.Module):
    """torchaudio's Conformer on (B, T, D) features, every sequence full length."""

    def __init__(self):
        super().__init__()
        import torchaudio.models as M
        self.m = M.Conformer(input_dim=16, num_heads=2, ffn_dim=32, num_layers=2, depthwise_conv_kernel_size=7)

    def forward(self, x):
        lengths = torch.full((x.shape[0],), x.shape[1], dtype=torch.int64)
        return self.m(x, lengths)[0]


@model("torchaudio", "torchaudio/Conformer", (2, 96, 16), shard_dims=(1,), spatial=(1,),
       note="self-attention with a key-padding mask, depthwise conv1d, BatchNorm1d over the split frames")
def _():
    return _Conformer()


@model("torchaudio", "torchaudio/HDemucs", (2, 2, 2048), note="time and spectral branches (stft / istft), "
       "strided convs, GroupNorm, frequency embedding")
def _():
    import torchaudio.models as M
    return M.HDemucs(sources=["a", "b"], audio_channels=2, channels=8, depth=3, nfft=256, norm_starts=2,
                     dconv_attn=9, dconv_lstm=9)

# ---- recurrences along time (IIR filters, effects)
# IIR filters run a recurrence sample after sample into a plain buffer of the global length: routed to the
# scan over ranks of shardtensor.integrations.torchaudio_filtering.
_tx("lowpass_biquad", lambda: lambda x: _F().lowpass_biquad(x * 0.3, _SR, 1000.0),
    note="IIR: a scan over the ranks (shardtensor.integrations)")
_tx("equalizer_highpass_chain", lambda: lambda x: _F().highpass_biquad(_F().equalizer_biquad(
    x * 0.3, _SR, 800.0, 6.0, 0.5), _SR, 200.0))
_tx("filtfilt", lambda: lambda x: _F().filtfilt(x * 0.3, torch.tensor([1.0, -1.2, 0.5], dtype=x.dtype),
                                                torch.tensor([0.1, 0.2, 0.1], dtype=x.dtype), clamp=False),
    note="forward and time-reversed IIR passes (a flip of the split signal between them)")
_tx("Deemphasis", lambda: _T().Deemphasis(0.97))
_tx("Loudness", lambda: _T().Loudness(_SR), shape=(2, 1, 3200), spatial_out=False,
    note="K-weighting biquads, gated block energies")


class _LearnableIIR(torch.nn.Module):
    """A learnable second-order IIR filter per channel (``lfilter`` with coefficients that are parameters)."""

    def __init__(self, channels=2):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor([[1.0, -0.6, 0.2], [1.0, 0.3, -0.1]])[:channels])
        self.b = torch.nn.Parameter(torch.tensor([[0.4, 0.3, 0.1], [0.2, -0.1, 0.3]])[:channels])

    def forward(self, x):
        import torchaudio.functional as F
        return F.lfilter(x, self.a.to(x.dtype), self.b.to(x.dtype), clamp=False)


@model("torchaudio", "torchaudio/lfilter_learnable", _STEREO, note="IIR coefficients as parameters: their "
       "gradients summed over the ranks' segments")
def _():
    return _LearnableIIR()
_tx("detect_pitch_frequency", lambda: lambda x: _F().detect_pitch_frequency(x, _SR), shape=(2, 1, 2400),
    spatial_out=False, forward_only=True)
_tx("Vad", lambda: _T().Vad(_SR), shape=(2, 1, 2400), spatial_out=False, forward_only=True)


@model("torchaudio", "torchaudio/DeepSpeech", (2, 1, 48, 16), note="frames split along time (dim 2): "
       "per-frame MLP, a bidirectional RNN relaying its state across the ranks")
def _():
    import torchaudio.models as M
    return M.DeepSpeech(n_feature=16, n_hidden=24, n_class=10)
