"""Encoders: the NNX BERT, checkpoint loading, and the DensePhrases dual encoder."""
from dpjax.models.bert import BertConfig, BertModel
from dpjax.models.densephrases import (DensePhrases, create_model, export_dense_phrases,
                                       load_dense_phrases, load_exported, model_for_data)
from dpjax.models.pretrained import load_pretrained_bert, resolve_model_dir
