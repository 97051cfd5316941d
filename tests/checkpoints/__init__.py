"""Checkpoint fixtures: real gcomp checkpoints captured from the code as it was at capture time (``data/``), the
recipes that made them (``recipes.py``, public API only), the script that regenerates them (``make_fixtures.py``:
``python -m tests.checkpoints.make_fixtures``) and the test that every one still loads (``test_fixtures_load.py``).

The files are the contract: a change to gcomp's checkpoint code must keep loading them. Regenerate them only to
add cases, never to make a failing load pass (a new format must read the old files, ``gcomp.hook/1`` and ``/2``
style: upgrade on load).
"""
