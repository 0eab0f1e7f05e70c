/* LD_PRELOAD library that keeps a process's listeners on one network interface.
 *
 * Open MPI's out-of-band TCP listener (mpirun and orted; PRRTE's too) binds INADDR_ANY and
 * in6addr_any whatever oob_tcp_if_include says, so a one-host job answers on every interface.
 * Preloaded with HVDTRAIN_BIND_INTERFACE=NAME, every bind() to a wildcard address binds to NAME's
 * address instead, or to loopback where NAME has none of that family; other binds are untouched.
 * Where neither NAME nor loopback has an IPv6 address, an IPv6 socket() fails with EAFNOSUPPORT,
 * which Open MPI takes for a machine without IPv6 (a failed bind would disable its TCP BTL).
 * The constructor takes the library and the variable out of the environment, so the processes
 * this one starts (ssh, and on one host the ranks) run without it; on several hosts mpirun hands
 * it to the ranks itself (-x), whose TCP BTL binds every interface too.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#define VARIABLE "HVDTRAIN_BIND_INTERFACE"

static int active;
static int have_v4, have_v6, loopback_v6;
static int (*real_socket)(int, int, int);
static int (*real_bind)(int, const struct sockaddr *, socklen_t);
static struct in_addr address_v4;
static struct sockaddr_in6 address_v6;

static void find_addresses(const char *interface) {
    struct ifaddrs *all, *entry;
    address_v4.s_addr = htonl(INADDR_LOOPBACK);
    address_v6.sin6_addr = in6addr_loopback;
    if (getifaddrs(&all) != 0) return;
    for (entry = all; entry != NULL; entry = entry->ifa_next) {
        if (entry->ifa_addr == NULL) continue;
        if (entry->ifa_addr->sa_family == AF_INET6 &&
            IN6_IS_ADDR_LOOPBACK(&((struct sockaddr_in6 *)entry->ifa_addr)->sin6_addr))
            loopback_v6 = 1;
        if (strcmp(entry->ifa_name, interface) != 0) continue;
        if (entry->ifa_addr->sa_family == AF_INET && !have_v4) {
            address_v4 = ((struct sockaddr_in *)entry->ifa_addr)->sin_addr;
            have_v4 = 1;
        } else if (entry->ifa_addr->sa_family == AF_INET6) {
            /* a global address over a link-local one: peers reach it without a scope */
            const struct sockaddr_in6 *found = (const struct sockaddr_in6 *)entry->ifa_addr;
            if (!have_v6 || (IN6_IS_ADDR_LINKLOCAL(&address_v6.sin6_addr) &&
                             !IN6_IS_ADDR_LINKLOCAL(&found->sin6_addr))) {
                address_v6 = *found;
                have_v6 = 1;
            }
        }
    }
    freeifaddrs(all);
}

/* Removes this library's own entry from LD_PRELOAD (a list split by ':' or ' '). */
static void leave_preload(void) {
    Dl_info self;
    const char *preload = getenv("LD_PRELOAD");
    if (preload == NULL || !dladdr((void *)leave_preload, &self) || self.dli_fname == NULL) return;
    size_t length = strlen(preload), own = strlen(self.dli_fname), kept_length = 0;
    char *kept = calloc(length + 1, 1);
    if (kept == NULL) return;
    const char *start = preload;
    while (*start) {
        size_t word = strcspn(start, ": ");
        if (word > 0 && !(word == own && strncmp(start, self.dli_fname, own) == 0)) {
            if (kept_length) kept[kept_length++] = ':';
            memcpy(kept + kept_length, start, word);
            kept_length += word;
        }
        start += word;
        start += strspn(start, ": ");
    }
    if (kept_length) setenv("LD_PRELOAD", kept, 1);
    else unsetenv("LD_PRELOAD");
    free(kept);
}

__attribute__((constructor)) static void setup(void) {
    real_socket = (int (*)(int, int, int))dlsym(RTLD_NEXT, "socket");
    real_bind = (int (*)(int, const struct sockaddr *, socklen_t))dlsym(RTLD_NEXT, "bind");
    const char *interface = getenv(VARIABLE);
    if (interface != NULL && *interface != '\0') {
        find_addresses(interface);
        active = 1;
    }
    unsetenv(VARIABLE);
    leave_preload();
}

int socket(int domain, int type, int protocol) {
    if (active && domain == AF_INET6 && !have_v6 && !loopback_v6) {
        errno = EAFNOSUPPORT;
        return -1;
    }
    return real_socket(domain, type, protocol);
}

int bind(int fd, const struct sockaddr *address, socklen_t length) {
    if (active && address != NULL) {
        if (address->sa_family == AF_INET && length >= sizeof(struct sockaddr_in) &&
            ((const struct sockaddr_in *)address)->sin_addr.s_addr == htonl(INADDR_ANY)) {
            struct sockaddr_in narrowed = *(const struct sockaddr_in *)address;
            narrowed.sin_addr = address_v4;
            return real_bind(fd, (const struct sockaddr *)&narrowed, sizeof narrowed);
        }
        if (address->sa_family == AF_INET6 && length >= sizeof(struct sockaddr_in6) &&
            IN6_IS_ADDR_UNSPECIFIED(&((const struct sockaddr_in6 *)address)->sin6_addr)) {
            struct sockaddr_in6 narrowed = *(const struct sockaddr_in6 *)address;
            narrowed.sin6_addr = address_v6.sin6_addr;
            narrowed.sin6_scope_id = have_v6 ? address_v6.sin6_scope_id : 0;
            return real_bind(fd, (const struct sockaddr *)&narrowed, sizeof narrowed);
        }
    }
    return real_bind(fd, address, length);
}
