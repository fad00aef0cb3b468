"""The words of a study's results page and of `dalle-ablate report`, in one place: what each section and figure shows,
and the verdict engine's outcomes; never how verdicts are reached (docs/statistics.md). `{name}` fields are filled
with `str.format`."""

from dalle_ablate.stats import verdicts as V

# -- the verdict engine's outcomes and verdicts, in the order of their codes -------------------------

OUTCOMES = (
    "higher by more than Δ",
    "higher",
    "equivalent within ±Δ",
    "lower",
    "lower by more than Δ",
    "not resolved",
    "identical on every seed",
)
VERDICTS = (
    "reproduced",
    "reproduced, possibly smaller than Δ",
    "no meaningful effect (equivalent within ±Δ)",
    "contradicted (reversed)",
    "not resolved",
    "untestable here",
)


def against_baseline(outcome: int, lower_is_better: bool) -> str:
    """The outcome of a variant against its baseline in words, for a metric whose better side is
    known: better / worse (by more than Δ), equivalent within ±Δ, not resolved."""
    if outcome in (V.EQUIVALENT, V.UNRESOLVED, V.IDENTICAL):
        return {
            V.EQUIVALENT: "equivalent to the baseline within ±Δ",
            V.UNRESOLVED: "not resolved",
            V.IDENTICAL: "identical to the baseline on every seed",
        }[outcome]
    better = (outcome in (V.LOWER, V.LOWER_BEYOND)) == lower_is_better
    beyond = " by more than Δ" if outcome in (V.HIGHER_BEYOND, V.LOWER_BEYOND) else ""
    return f"{'better' if better else 'worse'} than the baseline{beyond}"


# -- the noise report (report/noise.py), on both -----------------------------------------------

NOISE_INTRO = (
    "Where the seed noise of the final eval loss comes from, measured on these runs (docs/statistics.md, "
    '"The noise report"). Per arm: one run\'s sd across its seeds with its 95 % interval; the share of that '
    "variance that is the evaluation set (every run scores the same validation scenes: what varies from run "
    "to run on particular scenes, their runs x scenes interaction over the number of scenes; a larger set "
    "would cut it in proportion); and the sd the mean of the last evaluations would have instead of the "
    "final one (the checkpoint's part). Per comparison: the sd of one seed's difference, which its interval "
    "is judged on, rho, and the evaluation set's share of that difference's variance."
)

# -- late seeds (report/transitions.py), on both and in a sweep's re-check --------------------------

LATE_TITLE = "Late seeds"
LATE_RULE = (
    "Every seed's {metric} against the step, one panel per {group}. A run's caption-following transition is the "
    "first evaluation at which {metric} is below {level}{confirmed}; a seed is late where its transition comes "
    "more than {after} evaluation intervals after its {group}'s median, or never while the median does ({where}). "
    "Nothing is dropped or down-weighted for being late: every verdict uses every seed."
)
CONFIRMED = " and stays below at the next{k} evaluation{s} (a run's last evaluation counts alone)"
LATE = "{arm}: seed {seed} is late (transition {at}; {whose} median {median})."
NONE_LATE = "No seed is late by this rule."
LATE_COLUMNS = ["transition step by seed", "median", "evaluation interval (steps)", "late"]
NO_EVALUATIONS = "No run logged {metric}: no transition to find."
NO_CURVES = "Each run has one evaluation of {metric}: no curve to draw."
LATE_FIGURE = (
    "Every seed's {metric} ({unit}, log axis) against the training step, one panel per {group}, a line per "
    "seed: a dot at its transition, the dotted line the rule's level, a late seed drawn thick and named in its "
    "panel's title"
)

# -- seeds-needed, on both (seeds_words) ------------------------------------------------------

PLAN = (
    "a plan of {plan} seeds per arm if the true difference is the one observed ({fewest} to {most} across its "
    "95 % interval)"
)
PLAN_FLAT = (
    "a plan of {plan} seeds per arm if the true difference is the one observed (the same across its 95 % interval)"
)
FOR_MARGIN = "{needed} to tell a difference of Δ from 0"
BOTH_BEYOND = "more than {max} seeds per arm, whether the true difference is the one observed or Δ"
MORE_THAN = "more than {max}"


def seeds_count(n: int, max_seeds: int = V.MAX_SEEDS) -> str:
    """A count of seeds in words: the number, or "more than max_seeds"."""
    return MORE_THAN.format(max=max_seeds) if n > max_seeds else str(int(n))


def seeds_words(plan: int, fewest: int, most: int, needed: int, max_seeds: int = V.MAX_SEEDS) -> str:
    """What more seeds would do for a comparison not resolved: the plan (seeds_to_settle) and the seeds
    that tell Δ from 0 (seeds_needed; 0: no margin). "More than max_seeds" alone where it answers both."""
    if plan > max_seeds and needed > max_seeds:
        return BOTH_BEYOND.format(max=max_seeds)
    c = lambda x: seeds_count(x, max_seeds)  # noqa: E731
    words = (PLAN_FLAT if fewest == most == plan else PLAN).format(plan=c(plan), fewest=c(fewest), most=c(most))
    return words + ("; " + FOR_MARGIN.format(needed=c(needed)) if needed else "")


# -- a study's results page -------------------------------------------------------------------

SETTLED = "{k} findings, {settled} settled: {counts}."
HOW_TO_READ = (
    "Each claim is judged on its arm's per-seed differences from the arm it names, against the margin Δ its "
    "study file declared, at a family-wise 5 % over the {k} findings ([how, and why]({statistics})). "
    "Difference: in units of Δ, + on the side the claim predicts (beyond +1: it holds with room; within ±1: "
    "no meaningful effect). Seeds per arm: finished by both arms / a plan, for a finding not resolved: how many "
    "would settle it with 80 % power if its true difference were the one observed, with the range across its "
    "95 % interval / how many would tell a difference of Δ from 0 with 80 % power."
)
SUMMARY_COLUMNS = [
    "finding",
    "claim (metric)",
    "verdict",
    "difference in Δ (95% CI)",
    "seeds used / plan (range) / for Δ",
]
FOREST = (
    "Every finding's paired difference (arm minus the arm it is compared with), one line each, in units of its "
    "margin Δ, the side the claim predicts to the right: thick, the 95 % interval; thin, the family-wise one; "
    "shaded, ±Δ; the verdict in short at the right"
)

METHOD_TITLE = "How these verdicts were reached"
METHOD = (
    "The method -- pairing by seed, the three tests and Holm's procedure, the margins, seeds-needed, the noise "
    "report, the top-up rule, and their calibration on simulated studies of this structure -- is written once, "
    "in [statistics]({statistics})."
)
METRICS_LINE = "Metrics: {metrics}. Only finished runs are compared; the arms' table counts the others."
METRIC = "{name}: {key}, {what}, {reading}, in {unit}"
RUNS_LINE = (
    "These runs: {steps} steps of {batch} at d_model {d_model}, {enc} + {dec} layers ({params} parameters in "
    "the baseline), {seeds} seeds per arm at most."
)

CLAIMS_TITLE = "Every finding in full"
CLAIMS = (
    "Each finding in its metric's unit: the margin Δ, both arms' means, the paired difference with its 95 % and "
    "family-wise ({fw} %) intervals, the randomness its interval covers, rho (the two arms' correlation across "
    "seeds), the noise it is judged on (the sd of one seed's difference), Welch's unpaired interval (what pairing "
    "bought), the seeds, at how many evaluations the 95 % interval lay beyond 0 on the predicted side and on "
    "the other, and the verdict."
)
CLAIMS_COLUMNS = [
    "finding",
    "claim",
    "arm vs",
    "metric",
    "Δ margin",
    "arm",
    "vs",
    "difference",
    "95% CI",
    "family-wise CI",
    "randomness the interval covers",
    "rho",
    "noise",
    "Welch 95% CI",
    "seeds",
    "evaluations beyond 0: predicted / other side",
    "verdict",
]

NO_NOTES = "The study file gives no notes on its findings."
ARMS = (
    "Every arm is the baseline's configuration (conf/config.yaml with the experiment preset "
    "conf/experiment/{experiment}.yaml, which sets what all arms share: steps, evaluation, seeds) with the "
    "overrides of its file conf/arm/<arm>.yaml, chosen by `+arm=<arm>`. What each is, from the comment of its file:"
)
NOISE_METRICS = (
    "Per metric: the baseline's spread across seeds (one run's noise), the arms' own spreads (the least and "
    "the most spread arm: arms need not be equally noisy, and no finding borrows another's noise) and the "
    "seed's share of one run's variance from the two-way ANOVA of arm and seed (how much of it the arms "
    "share: what pairing removes). Where the noise comes from -- data order or initialisation -- a study "
    "tells apart only by varying one of the two at a time (Bouthillier et al. 2021)."
)
NOISE_SOURCES = (
    "The baseline's runs vary these sources one at a time: the spread of each metric among runs that differ "
    "only in that field (pooled over the groups that agree on every other)."
)
NOISE_ONE_SOURCE = "The baseline's runs vary every source together (through `seed`): the page cannot split them."
NOISE_EVALUATION = (
    "The shapes evaluation's own noise, apart from the seeds': the baseline's all-correct per guidance "
    "scale and tier (a fraction of the prompts, as both sds are), its sd across seeds, and the binomial "
    "sd over one run's prompts, sqrt(p (1 - p) / N). A seed spread near the prompt sd is mostly the "
    "evaluation's; every arm is scored on the same prompts with the same sampling noise, so a paired "
    "difference cancels what the prompts share."
)
TOPUP_RULE = (
    "Adding seeds (dalle-ablate study NAME --seeds auto): the study is topped up once, to the largest "
    "seeds-needed over all the findings of its own runs, resolved or not -- each computed from that finding's "
    "own noise (the sd of its per-seed differences) and its declared margin, never from an effect -- and "
    "judged again on all its seeds with the same tests ([statistics]({statistics}#adding-seeds-seeds) says "
    "why this keeps the error rate). A top-up to any other N (--seeds N) is valid only if N was fixed without "
    "looking at the verdicts."
)
TOPUP_NOW = "Now {now} seeds per arm at most; the rule asks for {target}{cap}."
TOPPED_UP = "Topped up from {from_} to {to} seeds per arm ({how}); the rule then asked for {rule}."
EVERY_ARM = (
    "Mean over the finished seeds with a 95% Student-t interval; loss spikes per run in seed order; runs whose "
    "loss stopped being finite. Step time measures the machine's load as well as the arm."
)
COURSE = (
    "Each finding's paired difference over training, one panel per finding in its metric's unit: at every "
    "evaluation, with its 95 % interval (judged as at the end) as a band, 0 and ±Δ as lines; a verdict at one "
    "budget can differ at another"
)
FINDING_CURVES = (
    "{id} ({claim}; {verdict}): {columns} against the training step, {arm} against {against}, the mean "
    "over each arm's seeds with its 95 % t interval as a band"
)
NO_RUNS = "{id}: no runs of {missing}."

# -- dalle-ablate report --------------------------------------------------------------------------

ANSWER = (
    "Each variant against the baseline, {baseline}, on the final metrics, in the words of the verdict engine a "
    "study's page uses (docs/statistics.md): better or worse where the difference is beyond its own seed noise "
    "(Holm over every difference of the report at a family-wise 5 %){margins}, else not resolved -- which is not "
    "equal. Each difference is the variant's mean minus the baseline's, with its 95 % interval."
)
ANSWER_MARGINS = ", by more than Δ or equivalent within ±Δ where --margin gave one ({margins})"
VARIANT = "{variant} — {judgements}."
JUDGEMENT = "{metric} {verdict} (difference {diff} {unit}, 95% CI [{low}, {high}], {how})"
ONE_SEED_JUDGEMENT = "{metric} {verdict} (difference {diff} {unit}; 1 seed: no interval)"
OVERVIEW = (
    "{runs} runs in {variants} variants (what differs between runs apart from the seed, as typed); baseline: "
    "{baseline} ({why})."
)
LEFT_OUT = "Left out of the comparisons, not completed: {runs}."
ONE_SEED = (
    "1 seed per variant: no difference can be tested. The tables give each run's value; rerun with seed=0,1,2 "
    "for intervals."
)
UNREADABLE = "Left out, unreadable ({n}): {what}."
FINAL = (
    "Last logged value per run: the difference from the baseline first, then each variant's mean over its seeds with "
    "a 95% Student-t interval (the curves' bands use the same). The difference is paired over the seeds both ran, "
    "or Welch's where they share fewer than two; rho is the two runs' correlation across the seeds they share, "
    "what pairing bought. {margin} How the verdict is reached: docs/statistics.md. A variant of one seed shows "
    "'{one_seed}'."
)
FINAL_MARGIN = "With --margin, the seeds a difference of Δ needs: {margins}."
FINAL_NO_MARGIN = "--margin METRIC=Δ adds the equivalence verdict and the seeds a difference of Δ needs."
CURVES = (
    "Lines are the mean over a variant's seeds; the band is the 95% Student-t interval of that mean (none with one "
    "seed). The gradient norm, on a log axis, shows the geometric mean and the interval of its logarithm, which "
    "stays positive."
)
STABILITY = (
    "Per run: loss spikes (steps whose train/loss exceeds 1.5x the median of the 20 steps before), gradient-norm "
    "peaks (5x), the largest gradient norm after warm-up (schedule.warmup_steps) and its step, and whether the "
    "loss stopped being finite; with float16 gradient scaling, the steps skipped on overflow."
)
COMPUTE = (
    "The eval loss against tokens seen, training wall time (the sum of step times: it measures the machine's load "
    "as well as the variant) and training FLOPs (steps x the model's FLOPs per step): variants of different cost "
    "compared at equal compute."
)
NO_PARETO = "No run has a sampling evaluation (eval.metrics) with a Pareto table."
FLAT_PARETO = (
    "Nothing to plot: {metric} is {value} at every guidance scale in every run, so no scale trades one axis "
    "for the other (runs.csv gives each run's values at every scale)."
)
TIERS = (
    "Shapes all-correct by difficulty tier at each guidance scale of the last evaluation: the rate, its 95% Wilson "
    "interval and N (prompts of that tier)."
)
NO_SHAPES = "No run has the shapes evaluation (eval.metrics=[shapes])."
SHAPES = (
    "The last evaluation, per guidance scale and tier, means over a variant's seeds: all-correct; the share of "
    "caption objects found (drawn at all); each attribute asked only of found objects (DSG) / over all checks (a "
    "missing object's attributes wrong, every extra object one more wrong check); the relation where both its "
    "objects were found (VISOR) / over all images, with that coverage; images with ink that is no object "
    '(unparsed). Chance for captions that do not belong to their images: docs/architecture.md, "The shapes '
    'evaluation".'
)
SHAPES_NOISE = (
    "The evaluation's own noise apart from the seeds': all-correct's standard deviation over seeds beside "
    "the binomial standard deviation over the prompts of one run (what re-drawing the prompts alone would "
    "move it by). A seed spread near the prompt noise is mostly the evaluation's."
)
SHAPES_PAIRED = (
    "Each variant against the baseline prompt by prompt: runs of the same seed, the same prompts and the same "
    "sampling noise ({same} equal), compared on each prompt's all-correct verdict. Δ with a 95% paired "
    "bootstrap interval over prompts; McNemar's exact p over the prompts right in one run only, pooled over "
    "the seed pairs. This is the evaluation's resolution at these seeds, not the seed spread (Final metrics "
    "compares over seeds)."
)
NO_GRIDS = "No prompt grids (eval.grids) were drawn in these runs."
GRIDS = (
    "The last evaluation's grids, every list, category and scale, one image each with the variants side by side "
    "(each variant's first seed; rows: prompts, columns: samples, the noise fixed across variants, scales and "
    "checkpoints)."
)
CONFIG = "The {n} config fields whose values differ between runs (others are the same everywhere)."
OPTUNA = "Study {name!r}, {metric} ({better} is better): {states}."

# -- a study in stages (report/staged.py) -----------------------------------------------------

STAGES_TITLE = "The stages"
STAGES_DESIGN = (
    "This study runs in two stages, declared in its study file before stage 1 ({declared}): stage 2's seeds per "
    "arm chosen from stage 1's results by the {rule} rule, at most {budget} and {cap} seeds per arm, its seeds "
    "from {seeds_from} on; each finding's stage-wise tests combined by the inverse-normal test (stage 1's weight "
    "{w1}) inside Holm's closed procedure over the findings, the two looks' boundaries spending α by {kind}. A "
    "finding judged on the stress runs has one look, its fixed-design test. Its difference is the combined "
    "estimate and its intervals are repeated confidence intervals, consistent with the combined test "
    "([how, and why]({statistics}#studies-in-stages))."
)
STAGE1 = "Stage 1: seeds {seeds}; look 1 settled {settled} of the {n} findings."
STAGE2_NOT_PLANNED = "Stage 2 is not planned yet: the verdicts are look 1's."
STAGE2_NONE = "Stage 2: the rule asked for no seed (no open finding it could raise): the verdicts are look 1's."
STAGE2_PLAN = "Stage 2: the rule spent {spent} of {budget}: {arms}."
STAGES_COLUMNS = ("finding", "look 1", "what the rule asked for, and why", "seeds per arm, stage 1 + 2", "by look 2")
REPORT_STAGES = (
    "This report's comparisons run in two stages, declared in its --stages file before stage 1 ({declared}): "
    "stage 1 the finished runs on seeds below {seeds_from}, stage 2's seeds per variant (from {seeds_from} on) chosen "
    "from stage 1's runs by the {rule} rule, at most {budget} and {cap} seeds per variant; each comparison's "
    "stage-wise tests combined by the inverse-normal test (stage 1's weight {w1}) inside Holm's closed procedure "
    "over the report's comparisons, the two looks' boundaries spending α by {kind}. Each difference is the "
    "combined estimate and its interval the repeated confidence interval (docs/statistics.md, 'Studies in "
    "stages'); a Δ given as a percentage is of stage 1's baseline. A run still training, or on a seed no stage "
    "has, is in none."
)
REPORT_STAGED_ANSWER = (
    "Judged in two declared stages (--stages): each difference here is the combined estimate over both stages' "
    "seeds and its interval the repeated confidence interval; 'The stages' says what stage 2 asks for and why."
)
REPORT_STAGE1 = "Stage 1: seeds {seeds}; look 1 settled {settled} of the {n} comparisons."
REPORT_STAGE2_RUN = (
    "Train them into a folder of their own, then report both folders' runs together (a glob of their run stores): "
    "{commands}."
)
REPORT_STAGES_COLUMNS = (
    "variant",
    "metric",
    "look 1",
    "what the rule asked for, and why",
    "seeds, stage 1 + 2",
    "by look 2",
)
STAGE2_NOTHING = "nothing: no seeds within the budget and the cap raised its chance to settle by look 2"
STAGE2_PAIRS = "{k} paired seeds: its chance to settle by look 2 with them {then}, planned at its observed difference"
STAGE2_SETTLED = "nothing: settled at look 1"
STAGE2_UNTESTED = "nothing: look 1 could not test it"
STAGE2_ELSEWHERE = "nothing: judged once, on the stress runs (a plan of their own)"
