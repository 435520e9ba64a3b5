"""Corpus readers (Pile jsonl / jsonl.zst, Parquet, Hugging Face datasets) and the sample-corpus builder."""
