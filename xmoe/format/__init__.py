"""The EXL3 tensor format, bit-compatible with exllamav3. Depends on nothing else in xmoe."""
from .codebook import CODEBOOKS, TARGET_STD, codebook_table, codebook_values
from .config import QuantConfig
from .hadamard import had_cols, had_rows, hadamard_128
from .layer import (SUFFIXES, FormatError, check_layer, decode_weight, is_exl3, layer_codebook, load_layer, marker,
                    pack_signs, padded, save_layers, scale_vectors, slice_layer, stored_layout,
                    unpack_signs)
from .trellis import (bits_from_trellis, check_tail_biting, decode_inner, matrix_to_tiles, pack_states,
                      state_windows, tile_perm, tiles_to_matrix, unpack_states)

__all__ = [
    "SUFFIXES", "CODEBOOKS", "TARGET_STD", "FormatError", "QuantConfig", "bits_from_trellis", "check_layer",
    "check_tail_biting", "codebook_table", "codebook_values", "decode_inner", "decode_weight", "had_cols",
    "had_rows", "hadamard_128", "is_exl3", "layer_codebook", "load_layer", "marker", "matrix_to_tiles",
    "pack_signs", "pack_states", "padded", "save_layers", "scale_vectors", "slice_layer", "state_windows",
    "stored_layout", "tile_perm",
    "tiles_to_matrix", "unpack_signs", "unpack_states",
]
