"""Drop-ins for trainers: ``gcomp.integrations.lightning`` (extra ``gcomp[lightning]``) and
``gcomp.integrations.accelerate`` (extra ``gcomp[accelerate]``), each imported only when asked for."""
