"""Examples of tasks written against the trainer's seam (``trainer.task.base.Task``)."""
