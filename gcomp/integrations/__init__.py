"""Drop-ins for trainers, each imported only when asked for: ``gcomp.integrations.lightning`` (extra
``gcomp[lightning]``), ``gcomp.integrations.accelerate`` (``gcomp[accelerate]``) and
``gcomp.integrations.transformers`` (the Hugging Face Trainer, ``gcomp[transformers]``)."""
