"""recorder: the trajectory log (Parquet, partitioned by job) and its DuckDB views (see service.py)."""
