"""recorder: the trajectory log (Parquet, partitioned by job) from the bus.

    service.py  one durable consumer per table; a message is acked once its rows are on disk
    store.py    bus messages -> rows -> Parquet parts
The DuckDB views over the log live in services/core/logdb.py.
"""
