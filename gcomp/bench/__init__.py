"""``gcomp bench``: the harness that trains every method under the same conditions over shaped links
(``runner``, ``worker``, ``workloads``, ``methods``, ``netem``, ``report``), the codec table (``--codec``), the
cost model behind ``gcomp simulate`` (``costmodel``, ``simulate``), and PacTrain's codec in its parts
(``python -m gcomp.bench.pactrain_codec``)."""
