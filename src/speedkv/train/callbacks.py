"""Trainer callbacks: the progress bar with the loss, and the periodic quality probe."""

from __future__ import annotations

import time


def progress_callback():
    """A tqdm bar over optimizer steps with the latest loss, CE, KL, lr and tokens/s."""
    from tqdm import tqdm
    from transformers import TrainerCallback

    class LossBar(TrainerCallback):
        bar = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(
                total=state.max_steps,
                initial=state.global_step,
                desc="training",
                dynamic_ncols=True,
            )

        def on_step_end(self, args, state, control, **kwargs):
            self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.bar is None or not logs or "loss" not in logs:
                return
            shown = {k: logs[k] for k in ("loss", "ce", "kl", "kl_full", "hidden") if k in logs}
            shown["lr"] = f"{logs.get('learning_rate', 0):.1e}"
            shown["tok/s"] = logs.get("tokens_per_s")
            self.bar.set_postfix(shown, refresh=True)

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()

    return LossBar()


def probe_callback(trainer, probe):
    """Runs a quality probe every `probe.every` steps and logs its numbers."""
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if state.global_step == 0 and state.is_world_process_zero:
                start = time.perf_counter()
                results = probe.run(trainer.objective)  # the untrained starting point
                trainer.exclude_time(time.perf_counter() - start)
                trainer.log(results)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % probe.every or not state.is_world_process_zero:
                return
            start = time.perf_counter()
            results = probe.run(trainer.objective)
            trainer.exclude_time(time.perf_counter() - start)  # not training throughput
            should_log = control.should_log  # logging the probe must not drop the loss entry
            trainer.log(results)
            control.should_log = should_log

    return Probe()
