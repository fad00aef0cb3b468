"""The report's own measures a study can judge, declared once (metrics.declare): computed from a
run's log (loss_spikes) or over the stress runs (lr_sensitivity, report/stress.py)."""

from dalle_ablate.metrics import Metric, declare
from dalle_ablate.report.load import series
from dalle_ablate.stats.basic import spikes

# lr_sensitivity first: the order they were declared in before they moved here, which the
# configuration reference lists them in
declare(
    Metric(
        "lr_sensitivity",
        "learning-rate sensitivity over the stress runs (Wortsman et al. 2023 §2.2)",
        "nats per image token",
        "lower",
        source="report",
        study="lr_sensitivity",
        reads="given",
        # a tenth of the baseline's degradation over the stress rates: a variant that moves how much the
        # loss degrades across a 100x range of rates by less than that is no stabler in a way that would
        # change which rate or variant one picks (Wortsman et al. 2023 compare variants whose
        # sensitivities differ by factors, not percents)
        margin="10%",
        covers="the stress runs' seeds (initialisation and data order at every rate)",
    )
)
declare(
    Metric(
        "loss_spikes",
        "steps whose train/loss exceeds 1.5x the median of the 20 before",
        "spikes per run",
        "lower",
        source="report",
        study="loss_spikes",
        margin="1",  # one loss spike per run
        value=lambda r: float(spikes(series(r, "train/loss")[1], factor=1.5)),
    )
)
