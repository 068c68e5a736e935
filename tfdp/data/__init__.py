"""Data: TFDS sources read by index, Poisson sampling over indices, batches.

Flow: a prepared TFDS split in ArrayRecord (`prepare_fashion_mnist`,
`prepare_synthetic_imagenet`, or `tfds build --file_format=array_record`)
-> `TFDSSource` (random access; nothing held in memory) -> `train_batches`
(an index stream from `poisson_indices`, the sampling the accountant assumes,
read and decoded in parallel) -> `pad_batches` (static shapes with a mask, for
XLA/TPU and replicas); the trainer instead uses `train_chunks`: the same index
stream, padded and cut into accumulation chunks, of which each host reads only
its replicas'. `eval_batches` streams the test split in order.
`ArraySource` holds arrays in memory instead (a small split, or cached
ScatterNet features, from `load_split`), and `JPEGFolderSource` reads a folder
of JPEG files (ImageNet's layout); `open_split` chooses one by config. Those
two read with TensorFlow ops only, and their batches are sampled in the graph
(`poisson_indices_in_graph`): the pure-TF input a TPU pod's hosts can run.
`mock_data` fakes any TFDS dataset for tests.
"""

from tfdp.data.array_source import ArraySource
from tfdp.data.errors import DatasetNotFoundError
from tfdp.data.fashion_mnist import prepare_fashion_mnist
from tfdp.data.graph_sampling import index_batches_in_graph
from tfdp.data.graph_sampling import poisson_indices_in_graph
from tfdp.data.splits import SOURCES
from tfdp.data.splits import check_duplicates
from tfdp.data.splits import open_split
from tfdp.data.jpeg_folder import JPEGFolderSource
from tfdp.data.loading import Split
from tfdp.data.loading import load_split
from tfdp.data.loading import read_split
from tfdp.data.mock import mock_data
from tfdp.data.padding import choose_static_batch_size
from tfdp.data.padding import delta_with_truncation
from tfdp.data.padding import pad_batch
from tfdp.data.padding import pad_batches
from tfdp.data.padding import truncation_probability
from tfdp.data.pipeline import eval_batches
from tfdp.data.pipeline import index_stream
from tfdp.data.pipeline import train_batches
from tfdp.data.pipeline import train_chunks
from tfdp.data.sampling import SAMPLING_SCHEMES
from tfdp.data.sampling import index_batches
from tfdp.data.sampling import poisson_indices
from tfdp.data.sampling import shuffled_indices
from tfdp.data.synthetic_imagenet import prepare_synthetic_imagenet
from tfdp.data.tfds_source import TFDSSource
from tfdp.data.tfds_source import dataset_identity
from tfdp.data.tfds_source import image_collection
from tfdp.data.tfds_source import is_tfds_dataset
from tfdp.data.tfds_source import same_dataset
from tfdp.data.tfds_source import raise_read_error
from tfdp.data.tfds_source import splits_overlap
