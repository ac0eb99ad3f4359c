/* Linked against libcuda.so.1 (the SIMULATED one at build time): it runs only where
 * the dynamic linker finds a libcuda.so.1, which inside a pod is the one the CDI spec
 * mounted. Prints what the library says, and which one it is. */
#include <stdio.h>

int cuInit(unsigned int flags);
int cuDeviceGetCount(int *count);
const char *shareguard_simulated_driver(void);

int main(void) {
  int n = -1;
  if (cuInit(0) != 0) {
    fprintf(stderr, "cuInit failed\n");
    return 1;
  }
  if (cuDeviceGetCount(&n) != 0) {
    fprintf(stderr, "cuDeviceGetCount failed\n");
    return 1;
  }
  printf("libcuda %s devices %d\n", shareguard_simulated_driver(), n);
  return 0;
}
