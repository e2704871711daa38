"""dpjax: dense phrase retrieval in JAX/Flax."""
from setuptools import find_packages, setup

SERVE = ["fastapi>=0.110,<1", "pydantic>=2,<3", "uvicorn>=0.30,<1", "prometheus_client>=0.20,<1",
         "fastapi-offline>=1.7,<2"]  # /docs' Swagger UI files, served without a CDN
BENCH = ["matplotlib>=3.8,<4"]

setup(
    name="dpjax",
    version="0.1.0",
    description="DensePhrases in JAX/Flax: phrase retrieval training, indexing and search.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["dpjax", "dpjax.*"]),
    # the service's search page, read from the package at import (dpjax/serve/app.py)
    package_data={"dpjax.serve": ["static/*.html"]},
    python_requires=">=3.11",
    entry_points={"console_scripts": ["dpjax = dpjax.cli:main"]},
    install_requires=[
        "jax>=0.8,<0.12",
        "flax>=0.12,<0.13",
        "optax>=0.2.5,<0.3",
        "orbax-checkpoint>=0.11,<0.13",
        "transformers>=5.0,<6",
        "tokenizers>=0.22,<0.24",
        "regex>=2023.0",  # \p{L} classes: DPR's tokenizer for passage Top-k (metrics.has_answer)
        "safetensors>=0.5,<0.9",
        "faiss-cpu>=1.9,<1.16",
        "numpy>=1.26,<3",
        "ml_collections>=1.0,<2",
        "tqdm>=4.66,<5",
        "tensorboardX>=2.6,<3",  # metrics.jsonl's scalars as TensorBoard event files
        "threadpoolctl>=3.1,<4",  # BLAS held at one thread while the rescoring threads run
        # hybrid search's BM25 index, with the English Porter2 stemmer (Pyserini stems so)
        "bm25s>=0.2,<0.4",
        "PyStemmer>=2.2,<4",
    ],
    extras_require={
        # `run.py serve`, its OpenAPI models and /metrics
        "serve": SERVE,
        # the benchmarks' figures
        "bench": BENCH,
        # the suite runs the service and the benchmarks; openapi-spec-validator and jsonschema
        # check the service's OpenAPI schema and its answers
        "test": ["pytest>=8,<10", "pytest-xdist>=3.5,<4", "hypothesis>=6.100,<7",
                 "openapi-spec-validator>=0.7,<1", "jsonschema>=4.18,<5", *SERVE, *BENCH,
                 "pdoc>=15,<17"],  # the API reference built from the docstrings (docs/api.md)
        # `jupyter nbconvert --execute` of experiments/notebooks/ (the tests run their code directly)
        "notebooks": ["nbconvert>=7,<8", "ipykernel>=6,<8", "matplotlib>=3.8,<4"],
        # the web page check of tests/test_serve.py and experiments/benchmarks/serve_load.py, with
        # Debian's chromium (`apt install chromium`); skipped without them
        "browser": ["playwright>=1.40,<2"],
        # CUDA 12 JAX plugin; the faiss GPU build is not on PyPI under a stable name, so it is
        # taken from conda (`conda install -c pytorch faiss-gpu`) when wanted: dpjax uses it
        # automatically when `faiss.StandardGpuResources` exists.
        "gpu": ["jax[cuda12]>=0.8,<0.12", "faiss-gpu-cu12>=1.9,<1.16"],
    },
)
