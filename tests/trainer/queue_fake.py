"""A stand-in for TRL's rollout queue (``trainer.rollout_queue``): hands out the samples it was
given, in order, with the ``qsize`` the queue wrappers pass through."""


class SampleQueue:
    def __init__(self, samples):
        self.samples = list(samples)

    def get(self, timeout=None):
        return self.samples.pop(0)

    def qsize(self):
        return len(self.samples)
