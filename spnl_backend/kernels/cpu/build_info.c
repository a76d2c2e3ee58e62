// What the loader asks of this build before any call: whether every index is checked, and
// the sizes of the argument structs, which the ctypes mirrors in __init__.py must match.

#include "common.h"

int spnl_full_checks(void) { return FULL_CHECKS; }
int64_t spnl_sizeof_products(void) { return sizeof(spnl_products); }
int64_t spnl_sizeof_paged_decode(void) { return sizeof(spnl_paged_decode_args); }
int64_t spnl_sizeof_coded_decode(void) { return sizeof(spnl_coded_decode_args); }
int64_t spnl_sizeof_qk(void) { return sizeof(spnl_qk_args); }
int64_t spnl_sizeof_step(void) { return sizeof(spnl_step_args); }
int64_t spnl_sizeof_layer(void) { return sizeof(spnl_layer_args); }
int64_t spnl_sizeof_group(void) { return sizeof(spnl_group); }
int64_t spnl_sizeof_moe(void) { return sizeof(spnl_moe_args); }
int64_t spnl_sizeof_lora_segment(void) { return sizeof(spnl_lora_segment); }
int64_t spnl_sizeof_lora_group(void) { return sizeof(spnl_lora_group); }
int64_t spnl_sizeof_lora_table(void) { return sizeof(spnl_lora_table); }
