#import "wsrm5.h"
#import "rmtest.h"
