/* SIMULATED libcuda: not NVIDIA's driver. It stands in for the driver's library in a
 * driver root that tests make on machines without a GPU, so that a container can be
 * shown to load libcuda.so.1 through the dynamic linker and to see the GPU nodes its
 * CDI spec gave it. cuDeviceGetCount counts the /dev/nvidia<N> nodes the container
 * has; nothing here touches a device. */
#include <dirent.h>
#include <string.h>

int cuInit(unsigned int flags) { return flags == 0 ? 0 : 1; /* CUDA_ERROR_INVALID_VALUE */ }

int cuDeviceGetCount(int *count) {
  DIR *d = opendir("/dev");
  struct dirent *e;
  int n = 0;
  if (!d) return 100; /* CUDA_ERROR_NO_DEVICE */
  while ((e = readdir(d))) {
    const char *p = e->d_name;
    if (strncmp(p, "nvidia", 6) != 0 || p[6] == '\0') continue;
    for (p += 6; *p >= '0' && *p <= '9'; p++) {}
    if (*p == '\0') n++;
  }
  closedir(d);
  *count = n;
  return 0;
}

const char *shareguard_simulated_driver(void) { return "SIMULATED"; }
