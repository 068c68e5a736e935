"""Stage 2, the input: the splits, checked against N, and the chunks each host reads.

`load_data` opens the splits (ArrayRecord by default; the pure-TF input or
a JPEG folder through `tfdp.data.open_split`), `train_dataset` builds the
per-host reader of the logical batches' chunks (Poisson or shuffled
sampling keyed by the secret seed, augmult views keyed by the public one).
"""

import tensorflow as tf
from absl import logging

from tfdp import augment
from tfdp import data


def load_data(data_config, *, prepare_train=None):
    """The two splits, opened for reading by index (`tfdp.data.open_split`).

    By default from ArrayRecord on disk (`tfdp.data.TFDSSource`); gin's
    `tfdp.data.open_split.source` chooses the pure-TF input instead (arrays
    in memory, or a JPEG folder). `prepare_train` (an audit's canaries) may
    change the training split first. The training split's size is then
    checked against NUM_EXAMPLES, which the accountant uses.
    """
    dataset, train_split, num_examples = (data_config.dataset, data_config.train_split,
                                          data_config.num_examples)
    kwargs = dict(data_dir=data_config.data_dir, image_size=data_config.image_size)
    train = data.open_split(dataset, train_split, **kwargs)
    if prepare_train is not None:
        train = prepare_train(train)
    test = data.open_split(dataset, data_config.test_split, **kwargs)
    if train.num_examples != num_examples:
        raise ValueError(
            f"NUM_EXAMPLES={num_examples} but the {dataset!r} split {train_split!r} has "
            f"{train.num_examples} examples. The accountant must use the real N: set "
            f"NUM_EXAMPLES = {train.num_examples} (or change the split)."
        )
    return train, test


def test_examples(eval_examples, test):
    """How many test examples each evaluation uses; says so when eval_examples asks for more.

    `eval_examples` is None or a positive int (`tfdp.configs.EvaluationConfig`).
    """
    if eval_examples is None:
        return test.num_examples
    if eval_examples > test.num_examples:
        logging.warning(
            "eval_examples=%d is more than the %d examples of the test split %r of %s: every "
            "evaluation uses all %d (metrics.jsonl says test_examples=%d).", eval_examples,
            test.num_examples, test.split, test.name, test.num_examples, test.num_examples)
    return min(eval_examples, test.num_examples)


def train_dataset(train, mechanism, *, seed, start_step, augment_fn, augment_seed, augmult,
                   static_batch_size=None, num_replicas=1, accumulation_steps=1):
    """The chunks of the logical batches that some replicas read: a builder per host.

    Returns `make_chunks(replicas: range) -> tf.data.Dataset` for
    `tfdp.training.distribute.distribute_chunks`: Poisson (or shuffled)
    index vectors, padded/truncated to the static size (or to a multiple of
    R * accumulation_steps), cut into R * accumulation_steps chunks, of which
    only `replicas`' are read, decoded and given their augmult views
    (`tfdp.data.train_chunks`). Each element is one chunk `(views, labels,
    mask)`; host memory holds a few chunks, not a logical batch.

    `train` is the split's source (`tfdp.data.TFDSSource`, or `ArraySource`
    for cached features). `seed` is the secret sampling seed
    (`tfdp.dp.seeds`); `augment_seed` the public one of the augmentations. An
    example's views at step t depend on (augment_seed, t, its pixels) only
    (`tfdp.augment.example_keyed_views`), so they are the same whatever
    chunk, replica or host reads it.
    """
    map_fn = None
    if augment_fn is not None:
        base_seed = augment.as_seed(augment_seed)

        def map_fn(step, images, labels):
            views = augment.example_keyed_views(
                images, tf.random.fold_in(base_seed, step), augment_fn=augment_fn,
                augmult=augmult)
            # Views stay uint8 pixels: 4x less host and device memory than float32.
            return augment.to_uint8_pixels(views), labels

    def make_chunks(replicas):
        return data.train_chunks(
            train, sampling=mechanism.sampling, batch_size=mechanism.batch_size,
            num_steps=mechanism.num_steps, seed=seed, start_step=start_step,
            num_replicas=num_replicas, accumulation_steps=accumulation_steps,
            replicas=replicas, static_batch_size=static_batch_size, map_fn=map_fn)

    return make_chunks
