"""Elastic LR scaling that composes with any LR scheduler: :func:`scale_lr`."""

from ._env import resume_step, scaled_lr

# The optimizer attribute that holds its scaling (one per optimizer).
_ATTR = "_elastic_run_lr_scaling"


class LRScaling:
    """The elastic scale applied to one optimizer's steps (see :func:`scale_lr`)."""

    def __init__(self, optimizer, step):
        self.optimizer = optimizer
        self._step_fn = step
        self._steps = 0
        self._saved = None
        self._handles = (optimizer.register_step_pre_hook(self._pre),
                         optimizer.register_step_post_hook(self._post))

    def step(self):
        """The training step the next ``optimizer.step()`` takes."""
        if self._step_fn is not None:
            return self._step_fn()
        return (resume_step() or 0) + self._steps + 1

    def factor(self, step=None):
        """What the LR is multiplied by at ``step`` (default: the next step): the elastic scale,
        ramped over ``--warmup-steps`` after the resume step."""
        return scaled_lr(1.0, self.step() if step is None else step)

    def _pre(self, optimizer, args, kwargs):
        f = self.factor()
        self._saved = []
        for group in optimizer.param_groups:
            lr = group["lr"]
            group["lr"] = lr * f
            self._saved.append((group, lr, group["lr"]))

    def _post(self, optimizer, args, kwargs):
        self._steps += 1
        saved, self._saved = self._saved, None
        for group, lr, scaled in saved or ():
            # Put back what the scheduler set, unless the step itself changed it.
            if group["lr"] is scaled:
                group["lr"] = lr

    def remove(self):
        """Stops scaling this optimizer's steps."""
        for h in self._handles:
            h.remove()
        if getattr(self.optimizer, _ATTR, None) is self:
            delattr(self.optimizer, _ATTR)


def scale_lr(optimizer, step=None):
    """Multiplies every LR ``optimizer`` steps with by elastic-run's scale, on top of whatever
    sets the LR: a constant, an LR scheduler, your own code. One line after making the optimizer::

        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
        elastic_run.scale_lr(opt)

    Each ``optimizer.step()`` runs with every param group's LR times the factor, the scale of
    ``--lr-scaling`` for the current world size ramped over ``--warmup-steps`` after the resume
    step (``scaled_lr(1.0, step)``); afterwards the group's LR is put back. So a scheduler, which
    reads and writes ``param_groups[i]["lr"]`` between steps, and the optimizer's
    ``state_dict()`` (and so every checkpoint) only ever see the unscaled LR: a rescale never
    compounds into the schedule, and a checkpoint resumes at any world size with that world's
    scale. Under plain ``torchrun`` the factor is 1.

    The step of the warm-up counts ``optimizer.step()`` calls from the resume step on; a loop
    whose steps do not each call it once (a GradScaler skipping a step on overflow) passes
    ``step``, a function returning the training step about to be taken. Returns an
    :class:`LRScaling` (its ``remove()`` undoes this); a second call for the same optimizer
    returns the first one's."""
    have = getattr(optimizer, _ATTR, None)
    if have is not None:
        return have
    s = LRScaling(optimizer, step)
    setattr(optimizer, _ATTR, s)
    return s
