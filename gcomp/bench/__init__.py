"""``gcomp bench``: the harness that trains every method under the same conditions over shaped links
(``runner``, ``worker``, ``workloads``, ``methods``, ``netem``, ``report``), the codec table (``--codec``), the
cost model behind ``gcomp simulate`` (``costmodel``, ``simulate``), and where one method's bucket reduction spends
its time (``python -m gcomp.bench.kernel_profile``)."""
