"""Model builders: every model maps float32 images in [0, 255] to logits.

No model mixes examples (no trainable BatchNorm): DP-SGD needs per-example
gradients, and `validate_dp_model` rejects a model that would. A pretrained
backbone's BatchNorm is frozen (`build_finetune_model`).
"""

from tfdp.models.feature_extractor import FrozenFeatureExtractor
from tfdp.models.feature_extractor import compute_model_features
from tfdp.models.finetune import BackboneError
from tfdp.models.finetune import build_finetune_model
from tfdp.models.finetune import frozen_feature_extractor
from tfdp.models.finetune import load_backbone
from tfdp.models.finetune import set_trainable
from tfdp.models.nf_res_block import NFResBlock
from tfdp.models.nf_resnet import build_nf_resnet
from tfdp.models.preprocessing import rescale_pixels_layer
from tfdp.models.preprocessing import scatternet_input_layer
from tfdp.models.scaled_ws_conv2d import ScaledWSConv2D
from tfdp.models.scatter_net import ScatterNet
from tfdp.models.scatternet_models import build_scatternet_classifier
from tfdp.models.scatternet_models import build_scatternet_cnn
from tfdp.models.scatternet_models import build_scatternet_gnws_cnn
from tfdp.models.scatternet_models import build_scatternet_linear
from tfdp.models.scatternet_models import compute_scatternet_features
from tfdp.models.tramer_cifar_cnn import build_tramer_cifar_cnn
from tfdp.models.tramer_cnn import build_tramer_cnn
from tfdp.models.validation import (ExampleMixingError, input_example_shape,
                                    refuse_example_mixing, user_defined_gradients,
                                    validate_dp_model, validate_float32)
from tfdp.models.wide_resnet import build_wide_resnet
from tfdp.models.ws_conv2d import WSConv2D
