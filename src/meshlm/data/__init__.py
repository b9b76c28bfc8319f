"""Megatron-compatible data: tokenizers, .bin/.idx files, GPT samples, blending, the DP sampler
and its loader.

The entry points the trainer uses (docs/interfaces.md): :func:`build_tokenizer`,
:func:`build_datasets`, ``loader.rank_loader``, :func:`check_token_ids`, :func:`prepare_default_corpus`,
``sources.blends``.
"""

from .blend import BlendedDataset, parse_data_path
from .corpus import prepare_default_corpus
from .gpt_dataset import GPTDataset, MockGPTDataset, build_datasets, split_ranges
from .indexed import IndexedDataset, IndexedDatasetWriter, check_token_ids
from .sampler import micro_batches
from .tokenizer import build_tokenizer, train_bpe
from .tokenizer_base import Tokenizer

__all__ = ["BlendedDataset", "GPTDataset", "IndexedDataset", "IndexedDatasetWriter", "MockGPTDataset",
           "Tokenizer", "build_datasets", "build_tokenizer", "check_token_ids", "micro_batches",
           "parse_data_path", "prepare_default_corpus", "split_ranges", "train_bpe"]
