/* SIMULATED libnvidia-ml: not NVIDIA's. A library of the right soname in a test driver
 * root; nothing loads it for real. */
int nvmlInit_v2(void) { return 9; /* NVML_ERROR_DRIVER_NOT_LOADED */ }
