"""The model zoo's twenty-seventh set: six more Hugging Face transformers audio models on a signal split along time (the
thirty-seventh session's probe), registered like zoo_models.py's (zoo_models.py imports this module at its end):
wav2vec2-Conformer (convolution modules, relative positions) and UniSpeech on a split waveform, Whisper's encoder on
split log-mel frames (two strided 1-D convolutions, fixed sinusoidal positions), the Audio Spectrogram Transformer
(2-D patches of a spectrogram split along time), and the encoders of the EnCodec (SEANet convolutions with an LSTM
over the split frames) and DAC (Snake activations, strided residual convolutions) codecs. All pass on 2, 3 and 4 ranks
with no library change."""

from benchmarks.zoo.zoo_models import model
from benchmarks.zoo.zoo_models_fourth import _Call
from benchmarks.zoo.zoo_models_seventh import _hf, _TINY_SPEECH


@model("transformers", "transformers/wav2vec2_conformer", (2, 1600), shard_dims=(1,), spatial=(1,), align=20,
       spatial_out=False)
def _():
    m = _hf("Wav2Vec2ConformerModel", "Wav2Vec2ConformerConfig", conv_depthwise_kernel_size=7,
            position_embeddings_type="relative", **_TINY_SPEECH)
    m.feature_extractor._requires_grad = False  # as zoo_models_seventh's speech encoders: the waveform requires grad
    return m


@model("transformers", "transformers/unispeech", (2, 1600), shard_dims=(1,), spatial=(1,), align=20,
       spatial_out=False)
def _():
    m = _hf("UniSpeechModel", "UniSpeechConfig", **_TINY_SPEECH)
    m.feature_extractor._requires_grad = False  # as zoo_models_seventh's speech encoders: the waveform requires grad
    return m


@model("transformers", "transformers/whisper_encoder", (2, 16, 64), shard_dims=(2,), spatial=(2,), align=4,
       spatial_out=False)
def _():
    import transformers
    cfg = transformers.WhisperConfig(num_mel_bins=16, d_model=32, encoder_layers=2, encoder_attention_heads=2,
                                     encoder_ffn_dim=64, decoder_attention_heads=2, decoder_layers=1,
                                     decoder_ffn_dim=64, max_source_positions=32, dropout=0.0, attention_dropout=0.0,
                                     activation_dropout=0.0, encoder_layerdrop=0.0)
    return transformers.WhisperModel(cfg).encoder


@model("transformers", "transformers/ast", (2, 64, 16), shard_dims=(1,), spatial=(1,), align=8, spatial_out=False)
def _():
    return _hf("ASTModel", "ASTConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=64, patch_size=8, num_mel_bins=16, max_length=64, frequency_stride=8, time_stride=8,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@model("transformers", "transformers/encodec", (2, 1, 640), shard_dims=(2,), spatial=(2,), align=32,
       spatial_out=False)
def _():
    net = _hf("EncodecModel", "EncodecConfig", hidden_size=16, num_filters=4, num_residual_layers=1,
              upsampling_ratios=[4, 2], codebook_size=16, codebook_dim=16, num_lstm_layers=1,
              target_bandwidths=[1.5], sampling_rate=320)
    return _Call(net, lambda n, x: n.encoder(x))


@model("transformers", "transformers/dac", (2, 1, 640), shard_dims=(2,), spatial=(2,), align=32, spatial_out=False)
def _():
    net = _hf("DacModel", "DacConfig", encoder_hidden_size=8, downsampling_ratios=[2, 4], decoder_hidden_size=16,
              n_codebooks=2, codebook_size=16, codebook_dim=4, hidden_size=32, upsampling_ratios=[4, 2])
    return _Call(net, lambda n, x: n.encoder(x))
