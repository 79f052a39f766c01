"""The ONNX export of all-MiniLM-L6-v2 (embeddings/onnx_export.py), run by onnxruntime on the
CPU against the numpy encoder it was exported from: the check that stands in for the GPU one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from sluice_triton_local.embeddings import EMBEDDING_DIM, MiniLMEncoder
from sluice_triton_local.embeddings.interface import ENCODER_INPUTS
from sluice_triton_local.embeddings.onnx_export import IR_VERSION, OPSET, OUTPUT_NAME
from sluice_triton_local.embeddings.minilm import TokenBatch
from conftest import MINILM_TEXTS as TEXTS
from conftest import ONNX_MAX_ABS_DIFF as MAX_ABS_DIFF


def run(session: ort.InferenceSession, batch: TokenBatch) -> np.ndarray:
    feeds = {name: getattr(batch, name) for name in ENCODER_INPUTS}
    (vectors,) = session.run([OUTPUT_NAME], feeds)
    return vectors


def test_graph_has_the_bert_export_interface(minilm_onnx_path: Path) -> None:
    model = onnx.load(str(minilm_onnx_path), load_external_data=False)
    assert (model.ir_version, [(o.domain, o.version) for o in model.opset_import]) == (IR_VERSION, [("", OPSET)])

    def signature(value: onnx.ValueInfoProto) -> tuple[str, int, list[str | int]]:
        dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
        return value.name, value.type.tensor_type.elem_type, dims

    int64, fp32 = onnx.TensorProto.INT64, onnx.TensorProto.FLOAT
    assert [signature(v) for v in model.graph.input] == [(name, int64, ["batch", "sequence"]) for name in ENCODER_INPUTS]
    assert [signature(v) for v in model.graph.output] == [(OUTPUT_NAME, fp32, ["batch", EMBEDDING_DIM])]


def test_padded_batch_matches_the_numpy_encoder(minilm_encoder: MiniLMEncoder, minilm_onnx_session: ort.InferenceSession) -> None:
    batch = minilm_encoder.tokenizer.batch(TEXTS)
    assert batch.input_ids.shape == (len(TEXTS), 256)  # the long text was truncated, the others padded
    vectors = run(minilm_onnx_session, batch)
    expected, counts = minilm_encoder.encode_with_counts(TEXTS)
    assert vectors.dtype == np.float32 and vectors.shape == (len(TEXTS), EMBEDDING_DIM)
    assert np.abs(vectors - expected).max() < MAX_ABS_DIFF
    assert np.abs(np.linalg.norm(vectors, axis=1) - 1.0).max() < 1e-6
    assert batch.counts.tolist() == counts.tolist()


def test_each_text_alone_gives_its_row_of_the_padded_batch(minilm_encoder: MiniLMEncoder, minilm_onnx_session: ort.InferenceSession) -> None:
    """Padding must not leak into a text's vector: the mask works inside the graph."""
    together = run(minilm_onnx_session, minilm_encoder.tokenizer.batch(TEXTS))
    for i, text in enumerate(TEXTS):
        alone = run(minilm_onnx_session, minilm_encoder.tokenizer.batch([text]))
        assert np.abs(alone[0] - together[i]).max() < MAX_ABS_DIFF, text


def test_different_texts_give_different_vectors(minilm_encoder: MiniLMEncoder, minilm_onnx_session: ort.InferenceSession) -> None:
    vectors = run(minilm_onnx_session, minilm_encoder.tokenizer.batch(TEXTS))
    similarity = vectors @ vectors.T
    assert similarity[np.triu_indices(len(TEXTS), k=1)].max() < 0.9


def test_an_empty_batch_gives_no_rows(minilm_encoder: MiniLMEncoder, minilm_onnx_session: ort.InferenceSession) -> None:
    batch = minilm_encoder.tokenizer.batch([])
    assert batch.input_ids.shape == (0, 0)
    assert run(minilm_onnx_session, batch).shape == (0, EMBEDDING_DIM)
