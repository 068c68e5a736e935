"""How each dataset that tfdp reads is prepared: its name and the command that prepares it.

One home for the commands that messages give (a dataset not prepared, a
damaged folder), so that the readers (`tfdp.data.tfds_source`) and the
preparers (`tfdp.data.fashion_mnist`, `tfdp.data.synthetic_imagenet`)
import this module rather than each other. Pure Python.
"""

FASHION_MNIST = "fashion_mnist"  # the stock TFDS name, read back by tfds.data_source
SYNTHETIC_IMAGENET = "synthetic_imagenet"
# The Debian package of the Fashion-MNIST release files (the only real data on this machine).
INSTALL_COMMAND = "apt-get update && apt-get install dataset-fashion-mnist"
REINSTALL_COMMAND = "apt-get install --reinstall dataset-fashion-mnist"


def prepare_command(dataset: str, data_dir) -> str:
    """The shell command that prepares `dataset` (a TFDS name) in `data_dir`, as ArrayRecord.

    Fashion-MNIST from its local files, the synthetic ImageNet by its
    generator, anything else with `tfds build` (which needs the network or
    the dataset's manual files).
    """
    if dataset == FASHION_MNIST:
        return f"python tools/prepare_fashion_mnist.py --data_dir={data_dir}"
    if dataset == SYNTHETIC_IMAGENET:
        return f"python tools/make_synthetic_imagenet.py --data_dir={data_dir}"
    return f"tfds build {dataset} --data_dir={data_dir} --file_format=array_record"
