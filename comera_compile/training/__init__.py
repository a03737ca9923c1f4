"""Rank-adaptive training (CoMERA): penalty, two stages, pruning with optimizer state,
history and plots. Pieces that drop into a plain PyTorch training loop."""

from comera_compile.nn import tensorized_layers
from comera_compile.training.bank import GateBank
from comera_compile.training.distill import distill, distill_loss, fit_layers
from comera_compile.training.distributed import PrunableDDP
from comera_compile.training.groups import param_groups
from comera_compile.training.history import History
from comera_compile.training.penalty import rank_penalty, soft_size
from comera_compile.training.plots import plot_compression, plot_ranks
from comera_compile.training.pruning import keep_min_rank, prune_model
from comera_compile.training.schedule import (
    EARLY,
    LATE,
    Plateau,
    SizeTargetSchedule,
    late_stage_loss,
    size_weight,
)
from comera_compile.training.size import (
    effective_ranks_by_layer,
    model_size,
    tensorized_compression,
)
from comera_compile.training.start import START_FACTOR, start_budget
from comera_compile.training.trainer import RankAdaptiveTrainer

try:  # FSDP2 needs torch.distributed, absent from some builds
    from comera_compile.training.sharded import (
        cut_to_checkpoint,
        full_state_dict,
        load_checkpoint,
        prune_sharded,
        save_checkpoint,
        shard,
    )
except ImportError:  # pragma: no cover
    pass

__all__ = ["SizeTargetSchedule", "EARLY", "GateBank", "LATE", "History", "Plateau", "PrunableDDP",
           "RankAdaptiveTrainer", "START_FACTOR", "cut_to_checkpoint", "distill", "distill_loss",
           "effective_ranks_by_layer", "fit_layers", "full_state_dict", "keep_min_rank",
           "late_stage_loss", "load_checkpoint", "model_size", "param_groups", "plot_compression",
           "plot_ranks", "prune_model", "prune_sharded", "rank_penalty", "save_checkpoint", "shard",
           "size_weight", "soft_size", "start_budget", "tensorized_compression",
           "tensorized_layers"]
