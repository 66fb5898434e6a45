/* glibc 2.38's C23 names of strtol, strtoul and sscanf. The native module links Debian
 * testing's libcrypto.a and libssl.a statically (scripts/build_native.py), and objects
 * built against glibc 2.38+ headers call these names; this machine's glibc (2.36,
 * bookworm) has only the C99 ones. The C23 versions differ in accepting a "0b" prefix,
 * which nothing OpenSSL parses with them uses. Hidden: they resolve only inside the
 * module. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#define HIDDEN __attribute__((visibility("hidden")))

HIDDEN long __isoc23_strtol(const char *s, char **end, int base);
HIDDEN unsigned long __isoc23_strtoul(const char *s, char **end, int base);
HIDDEN int __isoc23_sscanf(const char *s, const char *format, ...);

long __isoc23_strtol(const char *s, char **end, int base)
{
    return strtol(s, end, base);
}

unsigned long __isoc23_strtoul(const char *s, char **end, int base)
{
    return strtoul(s, end, base);
}

int __isoc23_sscanf(const char *s, const char *format, ...)
{
    va_list args;
    va_start(args, format);
    int n = vsscanf(s, format, args);
    va_end(args);
    return n;
}
