"""Images through the encoder, and their embeddings over NIXL: `python -m benchmarks.encoder`.

The encoder (EncoderEngine: vision tower + projector, the NIXL-registered arena that is its cache) runs in another
process, as the encoder role does; this process preprocesses the images and reads the embeddings as a prefill worker
does (EmbeddingReader: READ the slots, READ their generations, validate, release). Per model and batch size: encode
time per image (cache misses), images/s, the time a repeat takes (a cache hit: no encode), and the read ("transfer")
time per image beside the encode time.

Two random-weight LLaVAs are built offline: the test model (32x32 images, 16 tokens x 256 wide per image) and a larger
one (224x224 images, patch 14, a 6-layer tower: 256 tokens x 384 wide), or pass --model DIR.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pathlib
import statistics
import tempfile
import time

import numpy as np
import torch
from PIL import Image

from engine.multimodal.encoder import EncoderConfig, EncoderEngine
from engine.multimodal.image_inputs import ImageInputs

KEY = b"raypd-bench-encoder-cluster-key!"  # both processes sign and verify with it
TIMEOUT_S = 300.0
MODELS = {
    "tiny (tests)": dict(),
    "larger": dict(size="bench", vision_config=dict(image_size=224, patch_size=14, hidden_size=256,
                                                    intermediate_size=1024, num_hidden_layers=6)),
}


def _encoder_process(conn, model_dir: str, threads: int) -> None:
    """The encoder role: encodes what it is sent, answers (handles, seconds inside encode)."""
    torch.set_num_threads(threads)
    engine = EncoderEngine(model_dir, EncoderConfig(num_slots=512, cluster_key=KEY))
    conn.send("ready")
    while True:
        items = conn.recv()
        if items is None:
            break
        start = time.perf_counter()
        handles = engine.encode(items)
        conn.send((handles, time.perf_counter() - start))
    engine.close()


def _images(count: int, size: int, seed: int) -> list[Image.Image]:
    rs = np.random.RandomState(seed)
    return [Image.fromarray(rs.randint(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


def measure(model_dir: str, batches: tuple[int, ...], repeats: int, threads: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_encoder_process, args=(child, model_dir, threads), daemon=True)
    proc.start()
    try:
        if not conn.poll(TIMEOUT_S):
            raise TimeoutError("the encoder process did not start")
        conn.recv()
        inputs = ImageInputs(model_dir, "float32", cluster_key=KEY)
        try:
            return [_round(conn, inputs, b, repeats) for b in batches]
        finally:
            inputs.close()
    finally:
        conn.send(None)
        proc.join(TIMEOUT_S)
        if proc.is_alive():
            proc.kill()


def _call(conn, items):
    conn.send(items)
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError("the encoder process did not answer")
    return conn.recv()


def _round(conn, inputs: ImageInputs, batch: int, repeats: int) -> dict:
    processor, reader = inputs.processor, inputs.reader
    side = processor.image_size
    encode, hit, read, prep = [], [], [], []
    warm, _ = _call(conn, processor.preprocess(_images(batch, side, seed=10_000 + batch)))
    reader.read(reader.open(warm))  # connects to the encoder's agent: first contact is not part of a read
    for r in range(repeats):
        start = time.perf_counter()
        items = processor.preprocess(_images(batch, side, seed=batch * 100 + r))  # new images: misses
        prep.append(time.perf_counter() - start)
        params, seconds = _call(conn, items)
        encode.append(seconds)
        start = time.perf_counter()
        reader.read(reader.open(params))
        read.append(time.perf_counter() - start)
        hit.append(_call(conn, items)[1])  # the same images again: served from the cache
    spec = inputs.spec
    per = lambda xs: statistics.median(xs) / batch * 1e3  # noqa: E731  ms per image
    nbytes = spec.tokens_per_image * spec.text_hidden_size * 4
    return {"batch": batch, "shape": f"{spec.tokens_per_image} x {spec.text_hidden_size}", "kib": nbytes / 1024,
            "prep_ms": per(prep), "encode_ms": per(encode), "images_s": batch / statistics.median(encode),
            "hit_ms": per(hit), "read_ms": per(read), "gbs": nbytes * batch / statistics.median(read) / 1e9}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.encoder", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a LLaVA checkpoint directory (default: build two tiny ones)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the encoder process")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the reader's side: one thread, as a prefill worker on a small host runs
    with tempfile.TemporaryDirectory() as tmp:
        models = {pathlib.Path(args.model).name: args.model} if args.model else _build(pathlib.Path(tmp))
        print("| model | embeddings per image | KiB | images per call | preprocess ms/img | encode ms/img | "
              "images/s | cache hit ms/img | transfer ms/img | transfer GB/s | transfer / encode |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, path in models.items():
            for row in measure(str(path), tuple(args.batches), args.repeats, args.threads):
                print(f"| {name} | {row['shape']} | {row['kib']:.0f} | {row['batch']} | {row['prep_ms']:.2f} | "
                      f"{row['encode_ms']:.2f} | {row['images_s']:.0f} | {row['hit_ms']:.3f} | {row['read_ms']:.3f} "
                      f"| {row['gbs']:.2f} | {row['read_ms'] / row['encode_ms']:.1%} |", flush=True)


def _build(root: pathlib.Path) -> dict[str, pathlib.Path]:
    from raypd.tools.tiny import build_tiny_llava

    return {name: build_tiny_llava(root / f"m{i}", **kwargs) for i, (name, kwargs) in enumerate(MODELS.items())}


if __name__ == "__main__":
    main()
