"""Pretrain GPT -- shaped like Megatron-LM's ``pretrain_gpt.py`` (model provider, batch, loss, forward step,
dataset provider, ``pretrain(...)`` with an ``extra_args_provider``).

It imports ``megatron.training`` and so runs where Megatron-LM is installed: megatron-core 0.17 and later ship
it (Python 3.12; ``make test-megatron-latest`` runs this script on megatron-core 0.19.2's own loop, on the CPU:
``prepare_megatron_training`` of ``megatron_cpu.py``, and the Megatron flags in ``CPU_ARGS`` of
``tests/msprobe_integrations/megatron/test_megatron_training.py``). Under megatron-core 0.16 the tests run it
against a stand-in of ``megatron.training`` built on megatron-core (``tests/standins/megatron_lm``). It calls
whichever ``pretrain`` it finds: the older one that parses the arguments itself, or megatron-core 0.19's that
takes a config container built from ``parse_and_validate_args``. Nothing in it mentions msprobe: the launcher
adds the flags and the hooks without editing it::

    python -m msprobe_integrations.megatron recipes/pretrain_gpt.py --num-layers 2 --hidden-size 32 \\
        --num-attention-heads 4 --seq-length 16 --micro-batch-size 4 --train-iters 4 \\
        --msprobe-config dump.json --msprobe-monitor-config monitor.json

(Megatron-LM's real script reads its data with ``GPTDataset`` and a tokenizer; this one uses synthetic
tokens so it needs neither.)
"""

import inspect
from functools import partial

import torch
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training import get_args, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Build the model (``config`` and ``pg_collection`` are passed by megatron-core 0.19's ``get_model``; the
    default process groups are megatron-core's global ones)."""
    args = get_args()
    print_rank_0("building GPT model ...")
    config = config or core_transformer_config_from_args(args)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=False, **({} if vp_stage is None else {"vp_stage": vp_stage}))


def get_batch(data_iterator):
    """Generate a batch: tokens, labels, loss mask, attention mask, position ids."""
    data = next(data_iterator)
    tokens, labels = data["tokens"], data["labels"]
    seq = tokens.shape[1]
    attention_mask = torch.tril(torch.ones(1, 1, seq, seq)) < 0.5
    position_ids = torch.arange(seq).unsqueeze(0).expand_as(tokens)
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    return tokens, labels, loss_mask, attention_mask, position_ids


def loss_func(loss_mask, output_tensor):
    """Loss function: summed masked token loss, token count, and the loss to report."""
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}


def forward_step(data_iterator, model):
    """Forward training step."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


class _SyntheticGPTDataset(torch.utils.data.Dataset):
    def __init__(self, num_samples, seq_length, vocab_size, seed):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab_size, (max(num_samples, 1), seq_length + 1), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        return {"tokens": self.data[idx][:-1], "labels": self.data[idx][1:]}


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Build the train, validation and test datasets."""
    args = get_args()
    print_rank_0("> building synthetic train dataset for GPT ...")
    train_ds = _SyntheticGPTDataset(train_val_test_num_samples[0], args.seq_length, args.padded_vocab_size, args.seed)
    return train_ds, None, None


def add_gpt_args(parser):
    """This script's own extra arguments (composed with msprobe's by the launcher)."""
    group = parser.add_argument_group(title="pretrain_gpt")
    group.add_argument("--gpt-recipe-tag", type=str, default=None, help="a free-form tag (shows extra args compose)")
    return parser


ARGS_DEFAULTS = {"tokenizer_type": "NullTokenizer"}


def takes_config_container(pretrain_fn) -> bool:
    """Whether ``pretrain`` takes a config container first (Megatron-LM as shipped by megatron-core 0.19:
    ``pretrain(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func,
    model_provider=None, ...)``, the arguments parsed beforehand by ``parse_and_validate_args``) rather than
    the dataset provider (``pretrain(train_valid_test_dataset_provider, model_provider, model_type,
    forward_step_func, extra_args_provider=..., args_defaults=...)``, which parses them itself)."""
    return next(iter(inspect.signature(pretrain_fn).parameters)) == "cfg_container"


def main():
    if not takes_config_container(pretrain):
        pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                 extra_args_provider=add_gpt_args, args_defaults=ARGS_DEFAULTS)
        return
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=add_gpt_args, args_defaults=ARGS_DEFAULTS)
    if not torch.cuda.is_available():  # Megatron-LM's loop on the CPU: gloo and megatron_cpu.py's stand-ins
        from megatron_cpu import prepare_megatron_training

        prepare_megatron_training(args)
    pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)


if __name__ == "__main__":
    main()
