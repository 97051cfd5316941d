"""How a method serves FSDP2's reduce-scatter: the layout of its input in rows, one per destination shard
(``layout``), and the row strategy a method declares at registration (``strategy``), which lays the method's own
compressor's payload out in those rows, exchanges it and decodes this rank's row."""
from gcomp.sharding.layout import ShardLayout
from gcomp.sharding.strategy import EntrywiseRows, RowStrategy, exchange_rows

__all__ = ["EntrywiseRows", "RowStrategy", "ShardLayout", "exchange_rows"]
