"""The architecture families ``kernel-hub models`` enumerates (no torch import: the CLI parser
lists them)."""

FAMILIES: dict[str, str] = {
    "decoder": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "encoder": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "encoder-decoder": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "vision": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "speech": "MODEL_FOR_CTC_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "image-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
}
"""Family -> Transformers auto mapping (model_type -> class name) it is enumerated from."""
