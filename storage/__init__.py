"""Storage: atomic Parquet shards, completion records, DuckDB views, safe SQL."""
