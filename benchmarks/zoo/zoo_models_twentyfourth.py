"""The model zoo's twenty-fourth set: Hugging Face transformers' time-series forecasters on a series split along time
(the thirty-fifth session) -- PatchTSMixer (MLP mixing across the split patches, standard and mean scaling over the
split time, gated attention and channel mixing), PatchTST pre-training (random patch masking from the global
generator, reseeded alike), the vanilla Time Series Transformer (lagged inputs gathered by index from the split
context, time features, a mean scaler) and Autoformer (series decomposition by a moving average with replicate
padding, auto-correlation by FFT along the split time and its top-k delays rolled in; float32: the model builds
float32 tensors itself) and Informer (ProbSparse attention: keys sampled by `torch.randint` from the global generator,
reseeded alike, the top-u queries by an unsorted top-k; float32: its masked decoder attention starts from a float32
`cumsum` along time, whose split scan rounds differently from one device's sequential one -- 1e-9 relative in a
float64 run, float32 noise). Registered like zoo_models.py's (zoo_models.py imports this module at its end)."""
import torch

from benchmarks.zoo.zoo_models import model


def _series(name, shape, build, note, **kw):
    model("transformers", f"transformers/{name}", shape, shard_dims=(1,), spatial=(1,), spatial_out=False, note=note,
          **kw)(build)


def _mixer(**kw):
    import transformers
    return transformers.PatchTSMixerForPrediction(transformers.PatchTSMixerConfig(
        context_length=96, patch_length=8, patch_stride=8, num_input_channels=3, d_model=16, num_layers=2,
        prediction_length=12, dropout=0.0, head_dropout=0.0, **kw))


def _patchtst_pretraining():
    import transformers
    return transformers.PatchTSTForPretraining(transformers.PatchTSTConfig(
        num_input_channels=3, context_length=96, patch_length=8, patch_stride=8, num_hidden_layers=2, d_model=16,
        num_attention_heads=2, ffn_dim=32, attention_dropout=0.0, positional_dropout=0.0, path_dropout=0.0,
        ff_dropout=0.0, head_dropout=0.0, mask_type="random", random_mask_ratio=0.4, do_mask_input=True))


def _forecaster_config(**kw):
    """Small encoder-decoder forecaster settings shared by the Time Series Transformer and Autoformer: a context of 24
    steps after 3 lags (27 observed), 8 steps predicted, two time features, no dropout."""
    return dict(prediction_length=8, context_length=24, lags_sequence=[1, 2, 3], num_time_features=2, d_model=16,
                encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                encoder_ffn_dim=16, decoder_ffn_dim=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                encoder_layerdrop=0.0, decoder_layerdrop=0.0, scaling="mean", **kw)


def _forecaster_inputs(T=27, pred=8, feats=2):
    """The forward's other arguments (plain, the same on every rank): time features, the observed mask and the
    future targets of the teacher-forced decoder."""
    def make():
        g = torch.Generator().manual_seed(11)
        return {"past_time_features": torch.randn(2, T, feats, generator=g, dtype=torch.float64),
                "past_observed_mask": torch.ones(2, T, dtype=torch.float64),
                "future_values": torch.randn(2, pred, generator=g, dtype=torch.float64),
                "future_time_features": torch.randn(2, pred, feats, generator=g, dtype=torch.float64)}
    return make


def _time_series_transformer():
    import transformers
    return transformers.TimeSeriesTransformerForPrediction(
        transformers.TimeSeriesTransformerConfig(**_forecaster_config()))


def _informer():
    import transformers
    return transformers.InformerForPrediction(
        transformers.InformerConfig(**_forecaster_config(attention_type="prob", sampling_factor=2, distil=False)))


def _autoformer():
    import transformers
    return transformers.AutoformerForPrediction(
        transformers.AutoformerConfig(**_forecaster_config(moving_average=5, autocorrelation_factor=2)))


_series("patchtsmixer", (2, 96, 3), lambda: _mixer(scaling="std"),
        "MLP mixing across the split patches, std scaling over the split time", align=8)
_series("patchtsmixer_gated_mix_channels", (2, 96, 3),
        lambda: _mixer(mode="mix_channel", gated_attn=True, self_attn=True, self_attn_heads=2, scaling="mean"),
        "channel mixing, gated attention, patch self-attention", align=8)
_series("patchtst_pretrain_mask", (2, 96, 3), _patchtst_pretraining,
        "masked-patch pre-training: a random mask from the global generator", align=8, reseed=True)
_series("time_series_transformer", (2, 27), _time_series_transformer,
        "lagged values gathered from the split context, a mean scaler, encoder-decoder", extra=_forecaster_inputs())
_series("autoformer", (2, 27), _autoformer,
        "series decomposition (moving average), auto-correlation by FFT along the split time, top-k delays rolled",
        extra=_forecaster_inputs(), dtype="float32")
_series("informer", (2, 27), _informer,
        "ProbSparse attention: sampled keys, top-u queries, a float32 cumsum along the split time",
        extra=_forecaster_inputs(), dtype="float32", reseed=True)
