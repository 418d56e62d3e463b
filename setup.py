"""llm-refinery: LLM training-data preparation as Apache Beam pipelines.

The top-level folders install under one import namespace, ``refinery``:
``beam_pipelines`` -> ``refinery.beam_pipelines``, ``transforms`` -> ``refinery.transforms``,
and so on. ``kernels`` must never become a top-level module: it is also the name of a
PyPI package that transformers probes for.
"""
import warnings

from setuptools import find_packages, setup

# An editable install maps these folders through setuptools' import hook, and setuptools then
# cautions, on every `pip install -e .`, that "folders in your working directory with the same
# name as your package ... may take precedence during imports". The package is `refinery` and
# no folder of the checkout has that name (the checkout's root is the package), so the caution
# does not apply here: that one message is left out of `make demo`; every other warning stays.
warnings.filterwarnings("ignore", message=r"\s*Editable installation\.")

FOLDERS = ["beam_pipelines", "transforms", "kernels", "runners"]
# each folder and its subpackages (transforms/prep -> refinery.transforms.prep, ...)
PACKAGES = {f"refinery.{folder}" + (f".{sub}" if sub else ""): f"{folder}/{sub.replace('.', '/')}".rstrip("/")
            for folder in FOLDERS for sub in [""] + find_packages(folder)}

setup(
    name="llm-refinery",
    version="0.1.0",
    description="Prepare LLM training data (token shards, decontamination, synthetic data) with Apache Beam",
    python_requires=">=3.10",
    packages=list(PACKAGES),
    package_dir=PACKAGES,
    install_requires=[
        "apache-beam[gcp]>=2.60",
        "build>=1.0",  # Beam's stager builds the --setup_file sdist with `python -m build` (dataflow, flink)
        "numpy>=1.26",
        "tiktoken>=0.9",
        "bpe-openai>=0.1.4",  # ships o200k_base.tiktoken.gz: the offline vocab; the fast encoder where gigatoken is not
        # prep's fast encoder (--encoder fast): tiktoken's exact tokens a batch at a time, as buffers, with a bounded
        # encode cache (the official gigatoken 0.10.0's grows without bound); its wheels are Linux x86-64 only
        "gigatoken-cachefix>=0.10.1,<0.11; platform_system == 'Linux' and platform_machine == 'x86_64'",
        # gigatoken's batch result is an awkward array (it imports awkward itself); prep reads its two numpy buffers
        "awkward>=2.6.3; platform_system == 'Linux' and platform_machine == 'x86_64'",
        "tokenizers>=0.15",  # prep --tokenizer path/to/tokenizer.json (encode_special_tokens needs 0.15)
        "fsspec>=2024.6",
        "gcsfs>=2024.6",
        "datasets>=3.0",
        "msgpack>=1.0",
        "orjson>=3.9",  # JSON lines parsed fast (the standard parser words the errors)
        "pyarrow>=15",
        "zstandard>=0.22",
        "backports.zstd>=1.0; python_version < '3.14'",  # compression.zstd: bounded reads, truncation reported
        "isal>=1.6",  # gzip members of decon's details, ~4x faster than zlib at a smaller size
        "tqdm>=4.66",
        "tomli>=2.0; python_version < '3.11'",  # mixture TOML files (3.11+ has tomllib)
    ],
    extras_require={
        "test": [
            "pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.6", "transformers>=4.55", "matplotlib>=3.8",
            "gcp-storage-emulator>=2026.7.19",  # a local GCS for the gs:// tests
            "ruff>=0.17,<0.18",  # make lint (ruff.toml); a minor release may add checks: bumped on purpose
            "mypy==1.20.2",  # make lint (mypy.ini); a release may add errors: bumped on purpose
        ],
        "plots": ["matplotlib>=3.8"],  # refinery inspect --histogram
        "inference": [
            "torch==2.13.0",
            "safetensors>=0.4",
            "openai-harmony>=0.0.4",
            "triton>=3.0; platform_system == 'Linux'",
        ],
    },
    entry_points={"console_scripts": ["refinery=refinery.beam_pipelines.cli:entry"]},
)
